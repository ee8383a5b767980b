"""The vision tower (docs/vlm.md): patches -> linear patch embedding (a 3D convolution whose
stride is its kernel: time x height x width) + the learned position table interpolated to the
image's grid -> pre-norm ViT blocks (LayerNorm, bidirectional attention within each frame with
2D RoPE, GELU MLP) -> the merger (LayerNorm, ``m x m`` neighbouring patches concatenated, a
GELU MLP to the decoder's width).

Module and parameter names follow the Hugging Face checkpoints of Qwen3-VL / Qwen3.5
(``patch_embed.proj``, ``pos_embed``, ``blocks.<i>.attn.qkv`` ...), so the mapping of the tower's
weights is the identity under a prefix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.distributed.init_weights import ParamInit
from torchtitan.models.common.vision.args import VisionArgs
from torchtitan.models.common.vision.positions import (
    frame_lengths,
    interpolated_positions,
    patch_rows_cols,
)


def _act(name: str) -> nn.Module:
    return nn.GELU(approximate="tanh" if name == "gelu_pytorch_tanh" else "none")


def rope_2d(rows: torch.Tensor, cols: torch.Tensor, head_dim: int, theta: float) -> torch.Tensor:
    """Angles ``[N, head_dim / 2]``: the first half of the frequencies turn with the patch's row,
    the second half with its column (``head_dim / 4`` frequencies each, the same set)."""
    quarter = head_dim // 4
    inv = 1.0 / theta ** (torch.arange(quarter, device=rows.device, dtype=torch.float) / quarter)
    return torch.cat([rows[:, None].float() * inv, cols[:, None].float() * inv], dim=-1)


def rotate_halves(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """``x`` ``[N, H, Dh]`` rotated by ``angles`` ``[N, Dh/2]``: channel ``i`` pairs with
    ``i + Dh/2`` (float32 math, ``x``'s dtype out)."""
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).type_as(x)


class PatchEmbed(nn.Module):
    """Flattened patches ``[N, C * T * P * P]`` -> ``[N, dim]``."""

    def __init__(self, a: VisionArgs) -> None:
        super().__init__()
        self.shape = (a.in_channels, a.temporal_patch_size, a.patch_size, a.patch_size)
        self.proj = nn.Conv3d(a.in_channels, a.dim, self.shape[1:], stride=self.shape[1:])

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        x = patches.view(-1, *self.shape).to(self.proj.weight.dtype)
        return self.proj(x).flatten(1)


class VisionAttention(nn.Module):
    def __init__(self, a: VisionArgs) -> None:
        super().__init__()
        self.n_heads, self.head_dim = a.n_heads, a.head_dim
        self.qkv = nn.Linear(a.dim, 3 * a.dim)
        self.proj = nn.Linear(a.dim, a.dim)

    def forward(self, x: torch.Tensor, angles: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.n_heads, self.head_dim).unbind(1)
        q, k = rotate_halves(q, angles), rotate_halves(k, angles)
        outs = []
        for qs, ks, vs in zip(*(t.split(lengths) for t in (q, k, v)), strict=True):
            o = F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in (qs, ks, vs)))
            outs.append(o.transpose(0, 1))
        return self.proj((torch.cat(outs) if outs else v).reshape(n, self.n_heads * self.head_dim))


class VisionMLP(nn.Module):
    def __init__(self, a: VisionArgs) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(a.dim, a.intermediate_size)
        self.act = _act(a.hidden_act)
        self.linear_fc2 = nn.Linear(a.intermediate_size, a.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    """``h = x + attn(norm1(x)); out = h + mlp(norm2(h))``."""

    def __init__(self, a: VisionArgs) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(a.dim, eps=a.norm_eps)
        self.attn = VisionAttention(a)
        self.norm2 = nn.LayerNorm(a.dim, eps=a.norm_eps)
        self.mlp = VisionMLP(a)

    def forward(self, x: torch.Tensor, angles: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        h = x + self.attn(self.norm1(x), angles, lengths)
        return h + self.mlp(self.norm2(h))


class PatchMerger(nn.Module):
    """LayerNorm per patch, then each ``m x m`` block of patches (adjacent in patch order)
    concatenated and projected: ``[N, dim] -> [N / m^2, out_dim]``."""

    def __init__(self, a: VisionArgs) -> None:
        super().__init__()
        self.merged = a.dim * a.spatial_merge_size**2
        self.norm = nn.LayerNorm(a.dim, eps=a.norm_eps)
        self.linear_fc1 = nn.Linear(self.merged, self.merged)
        self.act = nn.GELU()
        self.linear_fc2 = nn.Linear(self.merged, a.out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x).view(-1, self.merged)
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionTower(nn.Module):
    """``forward(pixel_values [N, patch_dim], grid_thw [images, 3]) -> [N / m^2, out_dim]``,
    the merged tokens of all images in order."""

    def __init__(self, a: VisionArgs) -> None:
        super().__init__()
        self.args = a
        self.patch_embed = PatchEmbed(a)
        self.pos_embed = nn.Embedding(a.num_position_embeddings, a.dim)
        self.blocks = nn.ModuleList([VisionBlock(a) for _ in range(a.depth)])
        self.merger = PatchMerger(a)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        a = self.args
        m = a.spatial_merge_size
        x = self.patch_embed(pixel_values)
        x = x + interpolated_positions(self.pos_embed.weight, grid_thw, m).to(x.dtype)
        rows, cols = patch_rows_cols(grid_thw, m)
        angles = rope_2d(rows.to(x.device), cols.to(x.device), a.head_dim, a.rope_theta)
        lengths = frame_lengths(grid_thw)
        for block in self.blocks:
            x = block(x, angles, lengths)
        return self.merger(x)


def vision_init(name: str) -> ParamInit:
    """The init of the tower's parameter ``name`` (inside the tower): weights and the position
    table truncated normal (std 0.02), biases 0, LayerNorm scales 1."""
    if name.endswith(".bias"):
        return ParamInit("zeros")
    if name.endswith("norm.weight") or name.endswith(("norm1.weight", "norm2.weight")):
        return ParamInit("ones")
    return ParamInit("trunc_normal", std=0.02)
