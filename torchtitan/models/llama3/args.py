"""Llama 3 model arguments and the named flavors.

The shared fields, shape checks and closed-form parameter and FLOP counts are
``models/common/args.py``'s; what is Llama 3's own is the SwiGLU width rounding
(``hidden_dim``), ``head_dim = dim // n_heads``, Llama 3.1's RoPE frequency scaling and the
``depth_init`` choice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torchtitan.models.common.args import DecoderArgsBase, flavor_table
from torchtitan.models.common.rope import Llama3Scaling, RopeScaling


@dataclass
class ModelArgs(DecoderArgsBase):
    """Shape of a Llama 3 decoder-only transformer."""

    multiple_of: int = 256
    """The SwiGLU hidden width is rounded up to a multiple of this."""

    ffn_dim_multiplier: float | None = None
    """Optional factor applied to the SwiGLU hidden width before rounding (see ``hidden_dim``)."""

    rope_scaling: RopeScaling | None = None
    """RoPE frequency scaling (``models/common/rope.py``): Llama 3.1's ``Llama3Scaling`` (the
    published long-context flavors), ``LinearScaling`` or ``YarnScaling``; None: plain RoPE."""

    depth_init: bool = True
    """Scale the init std of the residual-branch output projections (wo, w2, w3) by the block's
    depth, ``0.02 / sqrt(2 * (layer_id + 1))``; when False, by the model's depth,
    ``0.02 / sqrt(2 * n_layers)``."""

    def __post_init__(self) -> None:
        if self.dim % self.n_heads != 0:
            raise ValueError(f"dim={self.dim} must be divisible by n_heads={self.n_heads}")
        super().__post_init__()

    @property
    def hidden_dim(self) -> int:
        """SwiGLU hidden width: ``4*dim``, times 2/3 (three matrices instead of two), times
        ``ffn_dim_multiplier`` when set, rounded up to a multiple of ``multiple_of``."""
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)


_COLUMNS: tuple[str, ...] = ("dim", "n_layers", "n_heads", "ffn_dim_multiplier", "multiple_of")
_COLUMNS += ("rope_scaling", "tie_word_embeddings")

LLAMA3_FLAVORS: dict[str, ModelArgs] = {
    "debugmodel": ModelArgs(dim=256, n_layers=6, n_heads=16, vocab_size=2048, max_seq_len=2048),
    **flavor_table(
        ModelArgs,
        _COLUMNS,
        {
            "1B": (2048, 16, 32, 1.5, 256, Llama3Scaling(32.0), True),  # shaped like Llama 3.2 1B
            "8B": (4096, 32, 32, 1.3, 1024, Llama3Scaling(8.0), False),
            "70B": (8192, 80, 64, 1.3, 4096, Llama3Scaling(8.0), False),
            "405B": (16384, 126, 128, 1.2, 4096, Llama3Scaling(8.0), False),
        },
        n_kv_heads=8,
        rope_theta=500000.0,
    ),
}
"""The named model shapes. The trainer replaces ``vocab_size`` (tokenizer) and ``max_seq_len``
(``training.seq_len``) with ``dataclasses.replace``."""
