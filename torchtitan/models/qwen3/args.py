"""Qwen3 model arguments and the named flavors (dense and Mixture-of-Experts).

The shared fields, shape checks and closed-form counts are ``models/common/args.py``'s. Qwen3
differs from Llama 3 in four places: the head width is its own field (``head_dim``, not
``dim // n_heads``), queries and keys are RMS-normalized per head before RoPE (QK-norm), the
SwiGLU width is given directly (``intermediate_size``), and the small flavors tie the embedding
to the output projection. Qwen3-MoE replaces the feed-forward of (some) blocks with a routed
Mixture-of-Experts (``models/common/moe.py``, docs/moe.md).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import ClassVar

from torchtitan.models.common.args import DEBUG_SHAPE, DecoderArgsBase
from torchtitan.models.common.moe import MoEArgs
from torchtitan.models.common.rope import RopeScaling


@dataclass
class Qwen3Args(DecoderArgsBase):
    """Shape of a Qwen3 (dense or MoE) decoder-only transformer. The published shapes are the
    flavors (``QWEN3_FLAVORS``); the defaults here are what every Qwen3 shares."""

    head_dim: int = 128  # type: ignore[assignment]
    """Width of one attention head (independent of ``dim`` in Qwen3)."""

    intermediate_size: int = 3072
    """Hidden width of the dense SwiGLU feed-forward."""

    moe: MoEArgs | None = None
    """The Mixture-of-Experts layer of the sparse blocks; ``None``: a dense model."""

    moe_layers: tuple[int, ...] | None = None
    """Block ids whose feed-forward is the MoE layer; ``None``: every block (when ``moe`` is
    set). Qwen3-MoE's ``mlp_only_layers`` are the complement."""

    rope_scaling: RopeScaling | None = None
    """RoPE frequency scaling (``models/common/rope.py``: YaRN, linear or Llama 3.1's; Qwen3's
    128k context is YaRN with factor 4 over 32768); None: plain RoPE."""

    sliding_window: int | None = None
    """Keys a windowed block's query sees (itself and the ``sliding_window - 1`` before, Hugging
    Face's ``use_sliding_window`` / ``sliding_window``); None: full causal attention."""

    window_layers: tuple[int, ...] | None = None
    """The blocks that use ``sliding_window``; None: every block (Qwen3-MoE applies it to all,
    dense Qwen3 to the blocks from ``max_window_layers`` on, or its ``layer_types``)."""

    n_kv_heads: int = 8
    # the norm eps also applies to the per-head QK-norms
    norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    max_seq_len: int = 40960

    qk_norm: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window={self.sliding_window} must be >= 1")
        if any(not 0 <= i < self.n_layers for i in self.window_layers or ()):
            raise ValueError(f"window_layers={self.window_layers} must be block ids")

    def with_n_layers(self, n: int) -> Qwen3Args:
        """At depth ``n``: the MoE and windowed block ids beyond it dropped."""

        def keep(ids: tuple[int, ...] | None) -> tuple[int, ...] | None:
            return None if ids is None else tuple(i for i in ids if i < n)

        return replace(
            self,
            n_layers=n,
            moe_layers=keep(self.moe_layers),
            window_layers=keep(self.window_layers),
        )

    def window(self, layer_id: int) -> int | None:
        """Block ``layer_id``'s sliding window, None for full causal attention."""
        if self.window_layers is not None and layer_id not in self.window_layers:
            return None
        return self.sliding_window

    @property
    def hidden_dim(self) -> int:
        """The dense SwiGLU width (the estimator's name for it)."""
        return self.intermediate_size

    def is_moe_layer(self, layer_id: int) -> bool:
        if self.moe is None:
            return False
        return self.moe_layers is None or layer_id in self.moe_layers

    @property
    def n_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))

    def flops_per_token(self, seq_len: int) -> int:
        """The base formula, where a windowed block's query reaches
        ``min(sliding_window, seq_len)`` keys, not ``seq_len`` (as GPT-OSS counts)."""
        full = super().flops_per_token(seq_len)
        per_key = 12 * self.n_heads * self.head_dim
        cut = sum(seq_len - min(self.window(i) or seq_len, seq_len) for i in range(self.n_layers))
        return full - per_key * cut

    def _ffn_params(self, layer_id: int, active: bool) -> int:
        if self.moe is not None and self.is_moe_layer(layer_id):
            return self.moe.num_params(self.dim, active=active)
        return super()._ffn_params(layer_id, active)


def _experts(*, expert_dim: int) -> MoEArgs:
    """The published Qwen3-MoE layer: 128 experts, top-8, softmax scores."""
    return MoEArgs(
        num_experts=128, top_k=8, expert_dim=expert_dim, score_func="softmax", aux_loss_coef=0.001
    )


_published = partial(Qwen3Args, n_kv_heads=8, head_dim=128, vocab_size=151936)
"""What the published Qwen3 shapes share: 8 key/value heads (the MoE ones: 4) of width 128,
the 151936-token vocabulary."""

_DEBUG = Qwen3Args(**DEBUG_SHAPE, n_layers=6, n_kv_heads=4, head_dim=32, intermediate_size=512)
_DEBUG_EXPERTS = MoEArgs(
    num_experts=8, top_k=2, expert_dim=128, num_shared_experts=1, aux_loss_coef=0.01
)

QWEN3_FLAVORS: dict[str, Qwen3Args] = {
    "debugmodel": _DEBUG,
    "debugmodel_moe": replace(_DEBUG, n_layers=4, moe=_DEBUG_EXPERTS),
    # Published shapes (Hugging Face config.json of Qwen/Qwen3-*).
    "0.6B": _published(dim=1024, n_layers=28, n_heads=16, intermediate_size=3072,
                       tie_word_embeddings=True),
    "1.7B": _published(dim=2048, n_layers=28, n_heads=16, intermediate_size=6144,
                       tie_word_embeddings=True),
    "4B": _published(dim=2560, n_layers=36, n_heads=32, intermediate_size=9728,
                     tie_word_embeddings=True),
    "8B": _published(dim=4096, n_layers=36, n_heads=32, intermediate_size=12288),
    "14B": _published(dim=5120, n_layers=40, n_heads=40, intermediate_size=17408),
    "32B": _published(dim=5120, n_layers=64, n_heads=64, intermediate_size=25600),
    "30B-A3B": _published(dim=2048, n_layers=48, n_heads=32, intermediate_size=6144,
                          n_kv_heads=4, moe=_experts(expert_dim=768)),
    "235B-A22B": _published(dim=4096, n_layers=94, n_heads=64, intermediate_size=12288,
                            n_kv_heads=4, moe=_experts(expert_dim=1536)),
}  # fmt: skip
"""The named shapes. The trainer replaces ``vocab_size`` (tokenizer) and ``max_seq_len``
(``training.seq_len``)."""

__all__ = ["QWEN3_FLAVORS", "MoEArgs", "Qwen3Args"]
