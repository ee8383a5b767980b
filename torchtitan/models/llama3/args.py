"""Llama 3 model arguments and the named flavors.

The shared fields, shape checks and closed-form parameter and FLOP counts are
``models/common/args.py``'s; what is Llama 3's own is the SwiGLU width rounding
(``hidden_dim``), ``head_dim = dim // n_heads``, Llama 3.1's RoPE frequency scaling and the
``depth_init`` choice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

from torchtitan.models.common.args import DecoderArgsBase
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


_published = partial(
    ModelArgs, n_kv_heads=8, rope_theta=500000.0, rope_scaling=Llama3Scaling(factor=8.0)
)
"""What the published Llama 3.1 shapes share: 8 key/value heads, RoPE base 500000 with Llama
3.1's frequency scaling (factor 8)."""

LLAMA3_FLAVORS: dict[str, ModelArgs] = {
    "debugmodel": ModelArgs(dim=256, n_layers=6, n_heads=16, vocab_size=2048, max_seq_len=2048),
    # shaped like Llama 3.2 1B
    "1B": _published(dim=2048, n_layers=16, n_heads=32, ffn_dim_multiplier=1.5, multiple_of=256,
                     rope_scaling=Llama3Scaling(factor=32.0), tie_word_embeddings=True),
    "8B": _published(dim=4096, n_layers=32, n_heads=32, ffn_dim_multiplier=1.3, multiple_of=1024),
    "70B": _published(dim=8192, n_layers=80, n_heads=64, ffn_dim_multiplier=1.3, multiple_of=4096),
    "405B": _published(dim=16384, n_layers=126, n_heads=128, ffn_dim_multiplier=1.2,
                       multiple_of=4096),
}  # fmt: skip
"""The named model shapes. The trainer replaces ``vocab_size`` (tokenizer) and ``max_seq_len``
(``training.seq_len``) with ``dataclasses.replace``."""
