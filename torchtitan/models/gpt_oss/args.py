"""GPT-OSS model arguments and the named flavors (docs/gpt_oss.md).

The shared fields, shape checks and closed-form counts are ``models/common/args.py``'s. GPT-OSS
differs from Llama 3 in: biased q/k/v/o projections and one learned attention-sink logit per
head; blocks alternating sliding-window (``sliding_window`` keys back) and full attention
(``layer_types``, Hugging Face's list); YaRN RoPE (``models/common/rope.py``); every block's
feed-forward a Mixture-of-Experts whose router and experts have biases and whose experts run a
clamped SwiGLU (``swiglu_limit``, ``swiglu_alpha``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from torchtitan.models.common.args import DEBUG_SHAPE, DecoderArgsBase, cycle_layers
from torchtitan.models.common.moe import MoEArgs
from torchtitan.models.common.rope import YarnScaling

SLIDING, FULL = "sliding_attention", "full_attention"


def alternating_layers(n_layers: int) -> tuple[str, ...]:
    """The published pattern: even blocks sliding-window, odd blocks full attention."""
    return tuple(SLIDING if i % 2 == 0 else FULL for i in range(n_layers))


@dataclass
class GptOssArgs(DecoderArgsBase):
    """Shape of a GPT-OSS decoder. The published shapes are the flavors (``GPT_OSS_FLAVORS``);
    the defaults here are what both share (``norm_eps`` the base's 1e-5)."""

    head_dim: int = 64  # type: ignore[assignment]
    """Width of one attention head (independent of ``dim``)."""

    moe: MoEArgs = field(default_factory=lambda: MoEArgs(num_experts=32, top_k=4, expert_dim=2880))
    """Every block's feed-forward: softmax over the top-k router logits (``route_norm``)."""

    sliding_window: int = 128
    """Keys a sliding-window layer's query sees: itself and the ``sliding_window - 1`` before."""

    layer_types: tuple[str, ...] | None = None
    """``sliding_attention`` / ``full_attention`` per block; None: :func:`alternating_layers`."""

    yarn: YarnScaling | None = YarnScaling(factor=32.0, original_max_seq_len=4096, truncate=False)
    """YaRN RoPE (``models/common/rope.py``); None: plain RoPE. Published: factor 32 over an
    original context of 4096, betas 32 / 1, no truncation of the ramp."""

    swiglu_limit: float = 7.0
    """Experts clamp the gate to at most this, the up projection to +-this."""
    swiglu_alpha: float = 1.702
    """Experts' gate: ``g * sigmoid(alpha * g)``."""

    n_kv_heads: int = 8
    rope_theta: float = 150000.0
    max_seq_len: int = 131072

    def __post_init__(self) -> None:
        super().__post_init__()
        types = self.layer_types
        if types is not None and (len(types) != self.n_layers or set(types) - {SLIDING, FULL}):
            raise ValueError(
                f"layer_types={types} must give {SLIDING!r} or {FULL!r} for each of the "
                f"{self.n_layers} layers"
            )
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window={self.sliding_window} must be >= 1")

    def with_n_layers(self, n: int) -> GptOssArgs:
        """At depth ``n``: the sliding/full alternation continued (or cut)."""
        types = None if self.layer_types is None else cycle_layers(self.layer_types, n)
        return replace(self, n_layers=n, layer_types=types)

    @property
    def hidden_dim(self) -> int:
        """The experts' width (GPT-OSS has no dense feed-forward)."""
        return self.moe.expert_dim

    def is_sliding(self, layer_id: int) -> bool:
        types = self.layer_types or alternating_layers(self.n_layers)
        return types[layer_id] == SLIDING

    def window(self, layer_id: int) -> int | None:
        """Block ``layer_id``'s sliding window, None for full attention."""
        return self.sliding_window if self.is_sliding(layer_id) else None

    def is_moe_layer(self, layer_id: int) -> bool:
        return True

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers

    def _attention_params(self) -> int:
        q, kv = self.n_heads * self.head_dim, self.kv_heads * self.head_dim
        biases = q + 2 * kv + self.dim
        return super()._attention_params() + biases + self.n_heads  # + sinks

    def _ffn_params(self, layer_id: int, active: bool) -> int:
        m = self.moe
        routed = m.top_k if active else m.num_experts
        router = m.num_experts * (self.dim + 1)
        expert = 3 * self.dim * m.expert_dim + 2 * m.expert_dim + self.dim  # with biases
        return router + routed * expert

    def flops_per_token(self, seq_len: int) -> int:
        """``6 * N`` (active, non-embedding) plus attention as in the base formula, where a
        sliding-window layer's query reaches ``min(sliding_window, seq_len)`` keys, not
        ``seq_len`` (the causal half is not subtracted, as in the base)."""
        keys = sum(
            min(self.sliding_window, seq_len) if self.is_sliding(i) else seq_len
            for i in range(self.n_layers)
        )
        attention = 12 * self.n_heads * self.head_dim * keys
        return 6 * self.num_params(exclude_embedding=True, active=True) + attention


GPT_OSS_FLAVORS: dict[str, GptOssArgs] = {
    "debugmodel": GptOssArgs(
        **DEBUG_SHAPE, n_layers=4, n_kv_heads=4, head_dim=32, sliding_window=32,
        moe=MoEArgs(num_experts=8, top_k=2, expert_dim=128),
        yarn=YarnScaling(factor=8.0, original_max_seq_len=256, truncate=False),
    ),
    # Published shapes (Hugging Face config.json of openai/gpt-oss-20b and -120b).
    "20b": GptOssArgs(dim=2880, n_layers=24, n_heads=64, vocab_size=201088),
    "120b": GptOssArgs(dim=2880, n_layers=36, n_heads=64, vocab_size=201088,
                       moe=MoEArgs(num_experts=128, top_k=4, expert_dim=2880)),
}  # fmt: skip
"""The named shapes. The trainer replaces ``vocab_size`` (tokenizer) and ``max_seq_len``
(``training.seq_len``); YaRN reads only its own ``original_max_seq_len``."""

__all__ = ["FULL", "GPT_OSS_FLAVORS", "SLIDING", "GptOssArgs", "alternating_layers"]
