"""What the families' args share (docs/extending.md, section 5): the fields every decoder-only
transformer has, the derived shape (``kv_heads``, ``head_dim``), the shape checks, and the
closed-form parameter and FLOP counts, which the memory estimator and the MFU metric read
without building a module (a 405B flavor costs nothing).

A family subclasses :class:`DecoderArgsBase` (a dataclass), changes the defaults it needs and
adds its own fields; it must say its dense SwiGLU width (``hidden_dim``) and, where a block's
feed-forward is not that SwiGLU, its size (``_ffn_params``, e.g. MoE).
"""

from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from torchtitan.config.errors import ConfigError

A = TypeVar("A")


@dataclass
class DecoderArgsBase(abc.ABC):
    """Shape of a decoder-only transformer (pre-norm blocks, GQA attention, SwiGLU)."""

    dim: int = 4096
    """Width of the residual stream (the model / embedding dimension, ``hidden_size``)."""

    n_layers: int = 32
    """Number of transformer blocks."""

    n_heads: int = 32
    """Number of query heads per attention layer."""

    n_kv_heads: int | None = None
    """Number of key/value heads (grouped-query attention); ``None`` means ``n_heads`` (MHA)."""

    vocab_size: int = 128256
    """Rows of the token embedding and columns of the output projection."""

    norm_eps: float = 1e-5
    """Epsilon of every RMSNorm."""

    rope_theta: float = 500000.0
    """Base of the rotary position embedding frequencies."""

    max_seq_len: int = 8192
    """Longest sequence (largest position + 1) the precomputed RoPE table covers."""

    tie_word_embeddings: bool = False
    """Share one matrix between the token embedding and the output projection."""

    attn_backend: str = "sdpa"
    """Kernel for block-causal attention (``doc_ids`` given to the forward): ``sdpa`` (a dense
    boolean mask, exact on every device) or ``flex`` (FlexAttention with a block mask, CUDA).
    The trainer sets it from ``model.attn_backend`` (docs/attention.md)."""

    qk_norm: ClassVar[bool] = False
    """Queries and keys are RMS-normalized per head (the memory estimator counts their saved
    tensors, ``planner/moe_memory.py``)."""

    def __post_init__(self) -> None:
        if self.n_heads % self.kv_heads != 0:
            raise ValueError(
                f"n_heads={self.n_heads} must be divisible by n_kv_heads={self.kv_heads}"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")

    def with_n_layers(self, n: int) -> Any:
        """These args at depth ``n``, every other dimension kept (``model.n_layers``,
        docs/moe.md, "Published shapes at a few layers"). A family whose per-block fields
        depend on the depth (layer kinds, dense prefix, windowed blocks) overrides it."""
        return dataclasses.replace(self, n_layers=n)

    @property
    def head_dim(self) -> int:
        """Width of one attention head: ``dim // n_heads`` (a family may make it a field)."""
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Number of key/value heads actually used (``n_kv_heads``, defaulting to ``n_heads``)."""
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    @abc.abstractmethod
    def hidden_dim(self) -> int:
        """Width of the dense SwiGLU feed-forward."""

    def _attention_params(self) -> int:
        d, hd = self.dim, self.head_dim
        projections = d * hd * (2 * self.n_heads + 2 * self.kv_heads)  # wq wo; wk wv
        return projections + (2 * hd if self.qk_norm else 0)  # q_norm, k_norm

    def _ffn_params(self, layer_id: int, active: bool) -> int:
        """Parameters of block ``layer_id``'s feed-forward (``active``: those one token uses)."""
        return 3 * self.dim * self.hidden_dim  # w1, w2, w3

    def _layer_params(self, layer_id: int, active: bool) -> int:
        norms = 2 * self.dim  # attention_norm, ffn_norm
        return self._attention_params() + self._ffn_params(layer_id, active) + norms

    def num_params(self, exclude_embedding: bool = False, active: bool = False) -> int:
        """Number of parameters of the built model, a shared (tied) matrix counted once.

        ``active``: only the parameters one token uses (MoE: top-k routed + shared experts).
        ``exclude_embedding`` leaves out the token-embedding lookup table. With tied embeddings
        the shared matrix is kept, because it is also the output projection's weight (a real
        matmul); so ``6 * num_params(exclude_embedding=True)`` is the dense-matmul FLOP count in
        both cases.
        """
        embedding = self.vocab_size * self.dim
        output = 0 if self.tie_word_embeddings else self.vocab_size * self.dim
        layers = sum(self._layer_params(i, active) for i in range(self.n_layers))
        total = embedding + layers + self.dim + output
        if exclude_embedding and not self.tie_word_embeddings:
            total -= embedding
        return total

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (forward + backward) at sequence length ``seq_len``.

        ``6 * N + 12 * n_layers * n_heads * head_dim * seq_len`` where ``N`` is the active
        non-embedding parameter count. ``6 * N``: each weight does one multiply-add (2 FLOPs) per
        token in the forward and twice that in the backward (a token runs only its routed
        experts). The second term is the attention itself: per layer and token, ``q @ k^T`` and
        ``scores @ v`` each cost ``2 * n_heads * head_dim * seq_len`` FLOPs forward, times 3 for
        forward + backward. The causal mask's skipped half is not subtracted (the usual
        convention for MFU; docs/performance.md).
        """
        attention = 12 * self.n_layers * self.n_heads * self.head_dim * seq_len
        return 6 * self.num_params(exclude_embedding=True, active=True) + attention


DEBUG_SHAPE: dict[str, Any] = {"dim": 256, "n_heads": 8, "vocab_size": 2048, "max_seq_len": 2048}
"""What the families' ``debugmodel`` flavors share (each adds its depth and its own fields)."""


def mtp_overrides(args: Any, model_cfg: Any) -> Any:
    """``args`` with ``model.mtp_depth`` / ``model.mtp_loss_weight`` applied where they are set
    (>= 0) and the args have those fields (multi-token prediction, docs/deepseek_v3.md);
    preflight refuses them for a family without."""
    changes = {"mtp_depth": model_cfg.mtp_depth, "mtp_loss_weight": model_cfg.mtp_loss_weight}
    changes = {k: v for k, v in changes.items() if v >= 0}
    if not changes or not hasattr(args, "mtp_depth"):
        return args
    return dataclasses.replace(args, **changes)


def cycle_layers(kinds: tuple[Any, ...], n: int) -> tuple[Any, ...]:
    """A per-block tuple at depth ``n``: its first ``n`` entries, repeated from the start where
    ``n`` is deeper (the published interleavings are periodic)."""
    return tuple(kinds[i % len(kinds)] for i in range(n)) if kinds else kinds


def layer_override(args: Any, model_cfg: Any) -> Any:
    """``args`` at ``model.n_layers`` blocks where it is set (>= 1; -1 keeps the flavor's),
    through the family's ``with_n_layers``; a family without one (the hf family, whose depth
    is its folder's) refuses it with a ``ConfigError``."""
    n = getattr(model_cfg, "n_layers", -1)
    if n == -1 or n == getattr(args, "n_layers", None):
        return args
    change = getattr(args, "with_n_layers", None)
    if not callable(change):
        raise ConfigError(
            "model.n_layers",
            n,
            f"{model_cfg.name} takes its depth from its folder's config.json",
            "remove --model.n_layers (or edit num_hidden_layers in a copy of the folder)",
        )
    return change(n)
