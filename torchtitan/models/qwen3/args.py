"""Qwen3 model arguments, the named flavors (dense and Mixture-of-Experts), and the analytic
parameter and FLOP counts.

Qwen3 differs from Llama 3 in four places: the head width is its own field (``head_dim``, not
``dim // n_heads``), queries and keys are RMS-normalized per head before RoPE (QK-norm), the
SwiGLU width is given directly (``intermediate_size``), and the small flavors tie the embedding
to the output projection. Qwen3-MoE replaces the feed-forward of (some) blocks with a routed
Mixture-of-Experts (``models/common/moe.py``, docs/moe.md).

The counts are closed-form, so they can be asked of the 235B flavor without building it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torchtitan.models.common.moe import MoEArgs


@dataclass
class Qwen3Args:
    """Shape of a Qwen3 (dense or MoE) decoder-only transformer."""

    dim: int = 1024
    """Width of the residual stream (``hidden_size``)."""

    n_layers: int = 28
    """Number of transformer blocks."""

    n_heads: int = 16
    """Number of query heads per attention layer."""

    n_kv_heads: int = 8
    """Number of key/value heads (grouped-query attention)."""

    head_dim: int = 128
    """Width of one attention head (independent of ``dim`` in Qwen3)."""

    intermediate_size: int = 3072
    """Hidden width of the dense SwiGLU feed-forward."""

    vocab_size: int = 151936
    """Rows of the token embedding and columns of the output projection."""

    norm_eps: float = 1e-6
    """Epsilon of every RMSNorm (the block norms and the per-head QK-norms)."""

    rope_theta: float = 1000000.0
    """Base of the rotary position embedding frequencies."""

    max_seq_len: int = 40960
    """Longest sequence (largest position + 1) the precomputed RoPE table covers."""

    tie_word_embeddings: bool = False
    """Share one matrix between the token embedding and the output projection."""

    attn_backend: str = "sdpa"
    """Kernel for block-causal attention (docs/attention.md); set by the trainer."""

    moe: MoEArgs | None = None
    """The Mixture-of-Experts layer of the sparse blocks; ``None``: a dense model."""

    qk_norm: ClassVar[bool] = True
    """Queries and keys are RMS-normalized per head (the memory estimator counts their saved
    tensors, ``plan/moe_memory.py``)."""

    moe_layers: tuple[int, ...] | None = None
    """Block ids whose feed-forward is the MoE layer; ``None``: every block (when ``moe`` is
    set). Qwen3-MoE's ``mlp_only_layers`` are the complement."""

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"n_heads={self.n_heads} must be divisible by n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads

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

    def _attention_params(self) -> int:
        d, hd = self.dim, self.head_dim
        projections = d * hd * (2 * self.n_heads + 2 * self.n_kv_heads)  # wq wo; wk wv
        return projections + 2 * hd  # q_norm, k_norm

    def _layer_params(self, layer_id: int, active: bool) -> int:
        norms = 2 * self.dim
        if self.moe is not None and self.is_moe_layer(layer_id):
            ffn = self.moe.num_params(self.dim, active=active)
        else:
            ffn = 3 * self.dim * self.intermediate_size
        return self._attention_params() + ffn + norms

    def num_params(self, exclude_embedding: bool = False, active: bool = False) -> int:
        """Parameters of the built model, a tied matrix counted once. ``active``: only the
        experts one token uses (top-k routed + shared), the MoE "A" in "30B-A3B".
        ``exclude_embedding`` as in Llama 3 (a tied matrix is kept: it is also the head)."""
        embedding = self.vocab_size * self.dim
        output = 0 if self.tie_word_embeddings else self.vocab_size * self.dim
        layers = sum(self._layer_params(i, active) for i in range(self.n_layers))
        total = embedding + layers + self.dim + output
        if exclude_embedding and not self.tie_word_embeddings:
            total -= embedding
        return total

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: ``6 x`` the active non-embedding parameters (each token
        runs only its routed experts) plus attention, ``12 * n_layers * n_heads * head_dim *
        seq_len`` (docs/performance.md)."""
        attention = 12 * self.n_layers * self.n_heads * self.head_dim * seq_len
        return 6 * self.num_params(exclude_embedding=True, active=True) + attention


def _dense(
    dim: int, n_layers: int, n_heads: int, inter: int, tie: bool, n_kv_heads: int = 8
) -> Qwen3Args:
    return Qwen3Args(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=128,
        intermediate_size=inter,
        tie_word_embeddings=tie,
    )


def _moe(dim: int, n_layers: int, n_heads: int, inter: int, moe_inter: int) -> Qwen3Args:
    return Qwen3Args(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=4,
        head_dim=128,
        intermediate_size=inter,
        moe=MoEArgs(
            num_experts=128,
            top_k=8,
            expert_dim=moe_inter,
            score_func="softmax",
            aux_loss_coef=0.001,
        ),
    )


QWEN3_FLAVORS: dict[str, Qwen3Args] = {
    "debugmodel": Qwen3Args(
        dim=256,
        n_layers=6,
        n_heads=8,
        n_kv_heads=4,
        head_dim=32,
        intermediate_size=512,
        vocab_size=2048,
        max_seq_len=2048,
    ),
    "debugmodel_moe": Qwen3Args(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        head_dim=32,
        intermediate_size=512,
        vocab_size=2048,
        max_seq_len=2048,
        moe=MoEArgs(
            num_experts=8,
            top_k=2,
            expert_dim=128,
            num_shared_experts=1,
            score_func="softmax",
            aux_loss_coef=0.01,
        ),
    ),
    # Published shapes (Hugging Face config.json of Qwen/Qwen3-*).
    "0.6B": _dense(1024, 28, 16, 3072, tie=True),
    "1.7B": _dense(2048, 28, 16, 6144, tie=True),
    "4B": _dense(2560, 36, 32, 9728, tie=True),
    "8B": _dense(4096, 36, 32, 12288, tie=False),
    "14B": _dense(5120, 40, 40, 17408, tie=False),
    "32B": _dense(5120, 64, 64, 25600, tie=False),
    "30B-A3B": _moe(2048, 48, 32, 6144, 768),
    "235B-A22B": _moe(4096, 94, 64, 12288, 1536),
}
"""The named shapes. The trainer replaces ``vocab_size`` (tokenizer) and ``max_seq_len``
(``training.seq_len``)."""

__all__ = ["QWEN3_FLAVORS", "MoEArgs", "Qwen3Args"]
