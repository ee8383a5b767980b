"""A MoonViT-style vision tower (Kimi K2.5; docs/vlm.md, "Kimi K2.5"): the shape
(:class:`MoonViTArgs`), the tower and the projector. Where it differs from the Qwen tower of
``tower.py``:

* patches are ``3 x P x P`` (no frames per patch; a 2D convolution), in raster order within an
  image (no merge-block order);
* the learned position table is resampled **bicubically** (half-pixel centres) to each image's
  grid; frames of a clip add a fixed sinusoid (none for a still image);
* q, k and v are one fused projection (``wqkv``) and the 2D RoPE turns adjacent channel pairs:
  pair ``2k`` of a head with the patch's column, pair ``2k + 1`` with its row, both by frequency
  ``theta ** (-4k / head_dim)``; attention spans the whole clip;
* a final LayerNorm, then each ``kh x kw`` block of patches is averaged over the frames and
  handed on as ``kh * kw`` vectors; the projector (``mm_projector``) normalizes each,
  concatenates them and maps them to the decoder's width (Linear, exact GELU, Linear).

Parameter names are the checkpoints' (``encoder.blocks.<i>.wqkv``, ``norm0``, ``mlp.fc0``,
``patch_embed.pos_emb.weight``, ``proj.0``), so their mapping is the identity under a prefix.
As the Qwen tower, the modules compute with the local values of their weights (``tower.py:
local``), so under tensor parallel the tower and projector run whole on every TP rank with
replicated parameters (``kimi_k25/parallel_plan.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.config.errors import ConfigError
from torchtitan.distributed.init_weights import ParamInit
from torchtitan.models.common.vision.args import ACTIVATIONS
from torchtitan.models.common.vision.tower import _layer_norm, _linear, local


@dataclass(frozen=True)
class MoonViTArgs:
    """The tower's shape (transformers' ``Kimi_K25VisionConfig`` defaults) and the projector's."""

    depth: int = 27
    dim: int = 1152
    n_heads: int = 16
    intermediate_size: int = 4304
    out_dim: int = 7168
    """The decoder's width (the projector's output)."""
    patch_size: int = 14
    pos_emb_height: int = 64
    pos_emb_width: int = 64
    pos_emb_time: int = 4
    """Frames the sinusoidal time table covers (videos; a still image adds none)."""
    merge_kernel: tuple[int, int] = (2, 2)
    rope_theta: float = 10_000.0
    hidden_act: str = "gelu_pytorch_tanh"
    norm_eps: float = 1e-5
    projection_eps: float = 1e-5
    in_channels: int = 3
    temporal_patch_size: int = 1
    processor: str = "navit"
    """How the data path resizes and cuts images (``data/vlm_images.py: NavitRules``)."""

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
                f"must split into num_attention_heads={self.n_heads} heads whose width is a "
                "multiple of 4 (the 2D RoPE turns pairs by column and by row)",
                "use a hidden_size divisible by 4 * num_attention_heads",
            )
        if self.pos_emb_height != self.pos_emb_width:
            return ConfigError(
                "vision_config.pos_emb_width",
                self.pos_emb_width,
                f"must equal pos_emb_height={self.pos_emb_height} (the reference resamples "
                "the table as a square grid)",
                "use a square position table",
            )
        kh, kw = self.merge_kernel
        if kh != kw or kh < 1:
            return ConfigError(
                "vision_config.merge_kernel_size",
                list(self.merge_kernel),
                "must be square and >= 1 (the image processor has one merge_size)",
                "use [2, 2] (the published models)",
            )
        if self.hidden_act not in ACTIVATIONS:
            return ConfigError(
                "vision_config.hidden_act",
                self.hidden_act,
                f"must be one of {ACTIVATIONS}",
                "use gelu_pytorch_tanh (the published models)",
            )
        return None

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def spatial_merge_size(self) -> int:
        return self.merge_kernel[0]

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.patch_size**2

    @property
    def num_position_embeddings(self) -> int:
        """The position table's rows (``height * width``), as the planner's tower memory reads
        them (``memory.py: tower_shapes``)."""
        return self.pos_emb_height * self.pos_emb_width

    def num_params(self) -> int:
        d, f, k = self.dim, self.intermediate_size, self.merge_kernel[0] * self.merge_kernel[1]
        block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * d * f + f + d
        embed = self.patch_dim * d + d + self.pos_emb_height * self.pos_emb_width * d
        kd = k * d
        projector = 2 * d + kd * kd + kd + kd * self.out_dim + self.out_dim
        return embed + self.depth * block + 2 * d + projector


def _grids(grid_thw: torch.Tensor) -> list[tuple[int, int, int]]:
    return [(int(t), int(h), int(w)) for t, h, w in grid_thw.tolist()]


def time_sinusoid(frames: int, dim: int) -> torch.Tensor:
    """``[frames, dim]``: ``sin`` then ``cos`` of frame ``f`` times ``10000 ** (-2i / dim)``."""
    inv = 1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = torch.arange(frames, dtype=torch.float32)[:, None] * inv
    return torch.cat([angles.sin(), angles.cos()], dim=1)


def bicubic_positions(table: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    """The learned table ``[side, side, D]`` resampled bicubically (half-pixel centres, edges
    clamped) to each image's ``h x w`` grid, raster order, repeated over its frames; frame ``f``
    of a clip of ``t > 1`` frames adds the time sinusoid's row ``f``: ``[N, D]``."""
    grid = table.permute(2, 0, 1)[None]  # [1, D, side, side]
    out = []
    for t, h, w in _grids(grid_thw):
        img = F.interpolate(grid, size=(h, w), mode="bicubic", align_corners=False)[0]
        pos = img.flatten(1).t().repeat(t, 1)  # [t * h * w, D]
        if t > 1:
            time = time_sinusoid(t, table.shape[-1]).to(pos)
            pos = pos + time.repeat_interleave(h * w, dim=0)
        out.append(pos)
    # no image on this rank: an empty slice of the table, so that it still joins the backward
    # (FSDP reduces the tower's gradients on every rank alike)
    return torch.cat(out) if out else table.flatten(0, 1)[:0]


def pair_rope_angles(grid_thw: torch.Tensor, head_dim: int, theta: float) -> torch.Tensor:
    """``[N, head_dim / 2]`` angles of the channel pairs of every patch (raster order, frames
    repeated): pair ``2k`` turns by the column, pair ``2k + 1`` by the row, frequency ``k`` of
    ``head_dim / 4``."""
    quarter = head_dim // 4
    inv = 1.0 / theta ** (torch.arange(quarter, dtype=torch.float32) * 4 / head_dim)
    rows, cols = [], []
    for t, h, w in _grids(grid_thw):
        rows.append(torch.arange(h).repeat_interleave(w).repeat(t))
        cols.append(torch.arange(w).repeat(h * t))
    if not rows:  # no image on this rank: the tower still runs (FSDP), on zero patches
        return torch.zeros(0, 2 * quarter)
    r, c = torch.cat(rows).float()[:, None] * inv, torch.cat(cols).float()[:, None] * inv
    return torch.stack([c, r], dim=-1).flatten(1)


def rotate_pairs(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """``x`` ``[N, H, Dh]`` with channels ``(2i, 2i + 1)`` rotated by ``angles[:, i]`` (float32
    math, ``x``'s dtype out)."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], x.shape[-1] // 2, 2))
    turned = pairs * torch.polar(torch.ones_like(angles), angles)[:, None]
    return torch.view_as_real(turned).flatten(-2).type_as(x)


def _act(name: str) -> nn.Module:
    return nn.GELU(approximate="tanh" if name == "gelu_pytorch_tanh" else "none")


class MoonViTMLP(nn.Module):
    def __init__(self, a: MoonViTArgs) -> None:
        super().__init__()
        self.fc0 = nn.Linear(a.dim, a.intermediate_size)
        self.act = _act(a.hidden_act)
        self.fc1 = nn.Linear(a.intermediate_size, a.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(self.fc1, self.act(_linear(self.fc0, x)))


class MoonViTBlock(nn.Module):
    """``h = x + wo(attn(norm0(x))); out = h + mlp(norm1(h))``; attention over each clip."""

    def __init__(self, a: MoonViTArgs) -> None:
        super().__init__()
        self.n_heads, self.head_dim = a.n_heads, a.head_dim
        self.norm0 = nn.LayerNorm(a.dim, eps=a.norm_eps)
        self.wqkv = nn.Linear(a.dim, 3 * a.dim)
        self.wo = nn.Linear(a.dim, a.dim)
        self.norm1 = nn.LayerNorm(a.dim, eps=a.norm_eps)
        self.mlp = MoonViTMLP(a)

    def attend(self, x: torch.Tensor, angles: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = _linear(self.wqkv, x).view(n, 3, self.n_heads, self.head_dim).unbind(1)
        q, k = rotate_pairs(q, angles), rotate_pairs(k, angles)
        outs = []
        for qs, ks, vs in zip(*(t.split(lengths) for t in (q, k, v)), strict=True):
            o = F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in (qs, ks, vs)))
            outs.append(o.transpose(0, 1))
        o = (torch.cat(outs) if outs else v).reshape(n, self.n_heads * self.head_dim)
        return _linear(self.wo, o)

    def forward(self, x: torch.Tensor, angles: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        h = x + self.attend(_layer_norm(self.norm0, x), angles, lengths)
        return h + self.mlp(_layer_norm(self.norm1, h))


class PositionTable(nn.Module):
    """The learned ``[height, width, dim]`` table (``pos_emb.weight``)."""

    def __init__(self, a: MoonViTArgs) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(a.pos_emb_height, a.pos_emb_width, a.dim))


class PatchEmbed(nn.Module):
    """``[N, 3 * P * P]`` (or ``[N, 3, P, P]``) -> ``[N, dim]``, plus the positions."""

    def __init__(self, a: MoonViTArgs) -> None:
        super().__init__()
        self.shape = (a.in_channels, a.patch_size, a.patch_size)
        self.proj = nn.Conv2d(a.in_channels, a.dim, a.patch_size, stride=a.patch_size)
        self.pos_emb = PositionTable(a)

    def forward(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        weight, bias = local(self.proj.weight), local(self.proj.bias)
        assert weight is not None
        x = F.conv2d(
            pixels.reshape(-1, *self.shape).to(weight.dtype), weight, bias, self.proj.stride
        )
        table = local(self.pos_emb.weight)
        assert table is not None
        return x.flatten(1) + bicubic_positions(table, grid_thw).to(x.dtype)


class MoonViTEncoder(nn.Module):
    def __init__(self, a: MoonViTArgs) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([MoonViTBlock(a) for _ in range(a.depth)])
        self.final_layernorm = nn.LayerNorm(a.dim, eps=a.norm_eps)


class MoonViT(nn.Module):
    """``forward(pixel_values [N, 3 * P * P], grid_thw [images, 3]) -> [M, kh * kw, dim]``: per
    merged token (images in order, raster order of the ``kh x kw`` blocks) its patches, averaged
    over the frames (the projector's input)."""

    def __init__(self, a: MoonViTArgs) -> None:
        super().__init__()
        self.args = a
        self.patch_embed = PatchEmbed(a)
        self.encoder = MoonViTEncoder(a)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        a = self.args
        x = self.patch_embed(pixel_values, grid_thw)
        angles = pair_rope_angles(grid_thw, a.head_dim, a.rope_theta).to(x.device)
        grids = _grids(grid_thw)
        lengths = [t * h * w for t, h, w in grids]
        for block in self.encoder.blocks:
            x = block(x, angles, lengths)
        x = _layer_norm(self.encoder.final_layernorm, x)
        kh, kw = a.merge_kernel
        merged = []
        for (t, h, w), clip in zip(grids, x.split(lengths), strict=True):
            clip = clip.view(t, h // kh, kh, w // kw, kw, -1).mean(0)
            merged.append(clip.permute(0, 2, 1, 3, 4).reshape(-1, kh * kw, x.shape[-1]))
        return torch.cat(merged) if merged else x.view(0, kh * kw, x.shape[-1])


class Projector(nn.Module):
    """``[M, K, dim] -> [M, out_dim]``: LayerNorm per patch, the ``K`` concatenated, Linear,
    exact GELU, Linear (``proj.0``, ``proj.2``)."""

    def __init__(self, a: MoonViTArgs) -> None:
        super().__init__()
        k = a.merge_kernel[0] * a.merge_kernel[1] * a.dim
        self.pre_norm = nn.LayerNorm(a.dim, eps=a.projection_eps)
        self.proj = nn.Sequential(nn.Linear(k, k), nn.GELU(), nn.Linear(k, a.out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fc0, act, fc1 = self.proj
        assert isinstance(fc0, nn.Linear) and isinstance(fc1, nn.Linear)
        x = _layer_norm(self.pre_norm, x).flatten(1)
        return _linear(fc1, act(_linear(fc0, x)))


def moonvit_init(name: str) -> ParamInit:
    """The init of a tower or projector parameter ``name``: weights and the position table
    truncated normal (std 0.02), biases 0, LayerNorm scales 1."""
    if name.endswith(".bias"):
        return ParamInit("zeros")
    if name.rsplit(".", 2)[-2] in ("norm0", "norm1", "final_layernorm", "pre_norm"):
        return ParamInit("ones")
    return ParamInit("trunc_normal", std=0.02)


__all__ = ["MoonViT", "MoonViTArgs", "Projector", "moonvit_init"]
