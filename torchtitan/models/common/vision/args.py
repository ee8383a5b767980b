"""The shape of a vision tower (``tower.py``; docs/vlm.md): a ViT over image patches whose
output, ``spatial_merge_size x spatial_merge_size`` patches merged into one token, is projected
to the decoder's width."""

from __future__ import annotations

import math
from dataclasses import dataclass

from torchtitan.config.errors import ConfigError

ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")


@dataclass(frozen=True)
class VisionArgs:
    """A ViT with 2D RoPE and a learned, interpolated position table (Qwen3-VL / Qwen3.5)."""

    depth: int = 27
    dim: int = 1152
    """Width of the tower (``hidden_size``)."""
    n_heads: int = 16
    intermediate_size: int = 4304
    """Width of each block's MLP."""
    out_dim: int = 3584
    """Width of a merged token: the decoder's ``dim`` (``out_hidden_size``)."""
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    """Frames per patch (a still image is repeated to fill them)."""
    spatial_merge_size: int = 2
    num_position_embeddings: int = 2304
    """Entries of the learned position table, a square grid (48 x 48)."""
    rope_theta: float = 10_000.0
    hidden_act: str = "gelu_pytorch_tanh"
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        problem = self.problem()
        if problem is not None:
            raise problem

    def problem(self) -> ConfigError | None:
        """What is wrong with the shape (fields named as in ``vision_config``), or None."""
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 4:
            return ConfigError(
                "vision_config.hidden_size",
                self.dim,
                f"must split into num_heads={self.n_heads} heads whose width is a multiple of "
                "4 (2D RoPE rotates a quarter of each head per axis)",
                "use a hidden_size divisible by 4 * num_heads",
            )
        side = math.isqrt(self.num_position_embeddings)
        if side * side != self.num_position_embeddings:
            return ConfigError(
                "vision_config.num_position_embeddings",
                self.num_position_embeddings,
                "must be a square (the learned table is a side x side grid)",
                f"use {side * side} or {(side + 1) ** 2}",
            )
        if self.hidden_act not in ACTIVATIONS:
            return ConfigError(
                "vision_config.hidden_act",
                self.hidden_act,
                f"must be one of {ACTIVATIONS}",
                "use gelu_pytorch_tanh (every published Qwen3.5)",
            )
        if min(self.patch_size, self.temporal_patch_size, self.spatial_merge_size) < 1:
            return ConfigError(
                "vision_config.patch_size",
                (self.patch_size, self.temporal_patch_size, self.spatial_merge_size),
                "patch_size, temporal_patch_size and spatial_merge_size must be >= 1",
                "use 16, 2 and 2 (the published models)",
            )
        return None

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def patch_dim(self) -> int:
        """Values of one flattened patch (``pixel_values``' last dimension)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def factor(self) -> int:
        """Image sides must be multiples of this (one merged token covers factor x factor)."""
        return self.patch_size * self.spatial_merge_size

    @property
    def grid_side(self) -> int:
        return math.isqrt(self.num_position_embeddings)

    def image_size_problem(self, height: int, width: int) -> ConfigError | None:
        """Why an image of ``height x width`` pixels cannot be cut into whole merged patches."""
        if height % self.factor == 0 and width % self.factor == 0 and height and width:
            return None
        return ConfigError(
            "image size",
            (height, width),
            f"must be positive multiples of patch_size * spatial_merge_size = {self.factor}",
            "resize images by the processor's rules (torchtitan/data/vlm_images.py: smart_resize)",
        )

    def num_params(self) -> int:
        d, f, m2 = self.dim, self.intermediate_size, self.spatial_merge_size**2
        block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * d * f + f + d
        merged = d * m2
        merger = 2 * d + merged * merged + merged + merged * self.out_dim + self.out_dim
        embed = self.patch_dim * d + d + self.num_position_embeddings * d
        return embed + self.depth * block + merger
