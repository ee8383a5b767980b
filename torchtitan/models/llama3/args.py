"""Llama 3 model arguments, the named flavors, and the analytic parameter and FLOP counts.

Nothing here builds a module: the counts are closed-form, so they can be asked of a 405B flavor
on a laptop (the memory estimator and the MFU metric both rely on that).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class ModelArgs:
    """Shape of a Llama 3 decoder-only transformer."""

    dim: int = 4096
    """Width of the residual stream (the model / embedding dimension)."""

    n_layers: int = 32
    """Number of transformer blocks."""

    n_heads: int = 32
    """Number of query heads per attention layer."""

    n_kv_heads: int | None = None
    """Number of key/value heads (grouped-query attention); ``None`` means ``n_heads`` (plain MHA)."""

    vocab_size: int = 128256
    """Rows of the token embedding and columns of the output projection."""

    multiple_of: int = 256
    """The SwiGLU hidden width is rounded up to a multiple of this."""

    ffn_dim_multiplier: float | None = None
    """Optional factor applied to the SwiGLU hidden width before rounding (see ``hidden_dim``)."""

    norm_eps: float = 1e-5
    """Epsilon of every RMSNorm."""

    rope_theta: float = 500000.0
    """Base of the rotary position embedding frequencies."""

    rope_scaling_factor: float | None = None
    """Llama 3.1/3.2 RoPE frequency scaling factor (long context); ``None`` disables the scaling."""

    rope_low_freq_factor: float = 1.0
    """RoPE scaling: wavelengths above ``rope_original_max_seq_len / rope_low_freq_factor`` are
    divided by the full scaling factor."""

    rope_high_freq_factor: float = 4.0
    """RoPE scaling: wavelengths below ``rope_original_max_seq_len / rope_high_freq_factor`` are
    left unchanged; those in between are interpolated smoothly."""

    rope_original_max_seq_len: int = 8192
    """RoPE scaling: the context length the unscaled frequencies were trained for."""

    max_seq_len: int = 8192
    """Longest sequence (largest position + 1) the precomputed RoPE table covers."""

    tie_word_embeddings: bool = False
    """Share one matrix between the token embedding and the output projection (Llama 3.2 1B/3B)."""

    attn_backend: str = "sdpa"
    """Kernel for block-causal attention (``doc_ids`` given to the forward): ``sdpa`` (a dense
    boolean mask, exact on every device) or ``flex`` (FlexAttention with a block mask, CUDA).
    The trainer sets it from ``model.attn_backend`` (docs/attention.md)."""

    depth_init: bool = True
    """Scale the init std of the residual-branch output projections (wo, w2, w3) by the block's
    depth, ``0.02 / sqrt(2 * (layer_id + 1))``; when False, by the model's depth,
    ``0.02 / sqrt(2 * n_layers)``."""

    def __post_init__(self) -> None:
        if self.dim % self.n_heads != 0:
            raise ValueError(f"dim={self.dim} must be divisible by n_heads={self.n_heads}")
        if self.n_heads % self.kv_heads != 0:
            raise ValueError(
                f"n_heads={self.n_heads} must be divisible by n_kv_heads={self.kv_heads}"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        """Width of one attention head: ``dim // n_heads``."""
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Number of key/value heads actually used (``n_kv_heads``, defaulting to ``n_heads``)."""
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def hidden_dim(self) -> int:
        """SwiGLU hidden width: ``4*dim``, times 2/3 (three matrices instead of two), times
        ``ffn_dim_multiplier`` when set, rounded up to a multiple of ``multiple_of``."""
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    def _layer_params(self) -> int:
        d, hd = self.dim, self.head_dim
        attention = d * self.n_heads * hd * 2 + d * self.kv_heads * hd * 2  # wq, wo; wk, wv
        feed_forward = 3 * d * self.hidden_dim  # w1, w2, w3
        norms = 2 * d  # attention_norm, ffn_norm
        return attention + feed_forward + norms

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Number of parameters of the built ``Transformer``, a shared (tied) matrix counted once.

        ``exclude_embedding`` leaves out the token-embedding lookup table. With tied embeddings the
        shared matrix is kept, because it is also the output projection's weight (a real matmul);
        so ``6 * num_params(exclude_embedding=True)`` is the dense-matmul FLOP count in both cases.
        """
        embedding = self.vocab_size * self.dim
        output = 0 if self.tie_word_embeddings else self.vocab_size * self.dim
        total = embedding + self.n_layers * self._layer_params() + self.dim + output
        if exclude_embedding and not self.tie_word_embeddings:
            total -= embedding
        return total

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (forward + backward) at sequence length ``seq_len``.

        ``6 * N + 12 * n_layers * n_heads * head_dim * seq_len`` where ``N`` is
        ``num_params(exclude_embedding=True)``. ``6 * N``: each weight does one multiply-add
        (2 FLOPs) per token in the forward and twice that in the backward. The second term is the
        attention itself: per layer and token, ``q @ k^T`` and ``scores @ v`` each cost
        ``2 * n_heads * head_dim * seq_len`` FLOPs forward, times 3 for forward + backward.
        The causal mask's skipped half is not subtracted (the usual convention for MFU).
        """
        attention = 12 * self.n_layers * self.n_heads * self.head_dim * seq_len
        return 6 * self.num_params(exclude_embedding=True) + attention


LLAMA3_FLAVORS: dict[str, ModelArgs] = {
    "debugmodel": ModelArgs(
        dim=256,
        n_layers=6,
        n_heads=16,
        rope_theta=500000.0,
        vocab_size=2048,
        multiple_of=256,
        max_seq_len=2048,
    ),
    # Shaped like Llama 3.2 1B.
    "1B": ModelArgs(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim_multiplier=1.5,
        multiple_of=256,
        rope_theta=500000.0,
        rope_scaling_factor=32.0,
        tie_word_embeddings=True,
        vocab_size=128256,
    ),
    "8B": ModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim_multiplier=1.3,
        multiple_of=1024,
        rope_theta=500000.0,
        rope_scaling_factor=8.0,
    ),
    "70B": ModelArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim_multiplier=1.3,
        multiple_of=4096,
        rope_theta=500000.0,
        rope_scaling_factor=8.0,
    ),
    "405B": ModelArgs(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        ffn_dim_multiplier=1.2,
        multiple_of=4096,
        rope_theta=500000.0,
        rope_scaling_factor=8.0,
    ),
}
"""The named model shapes. The trainer replaces ``vocab_size`` (tokenizer) and ``max_seq_len``
(``training.seq_len``) with ``dataclasses.replace``."""
