"""The vision tower (docs/vlm.md): patches -> linear patch embedding (a 3D convolution whose
stride is its kernel: time x height x width) + the learned position table interpolated to the
image's grid -> pre-norm ViT blocks (LayerNorm, bidirectional attention within each frame with
2D RoPE, GELU MLP) -> the merger (LayerNorm, ``m x m`` neighbouring patches concatenated, a
GELU MLP to the decoder's width).

Module and parameter names follow the Hugging Face checkpoints of Qwen3-VL / Qwen3.5
(``patch_embed.proj``, ``pos_embed``, ``blocks.<i>.attn.qkv`` ...), so the mapping of the tower's
weights is the identity under a prefix.

The modules compute with the local values of their weights (``local``): under tensor parallel the
tower runs whole on every TP rank with its parameters replicated DTensors
(``distributed/replicate_parallel.py: ReplicateWeights``); otherwise they are plain tensors. The
attention within each frame runs eagerly (``frame_attention``; a graph break under compile), so
a compiled block does not recompile for every new set of image sizes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan.distributed.init_weights import ParamInit
from torchtitan.models.common.vision.args import VisionArgs
from torchtitan.models.common.vision.positions import (
    frame_lengths,
    interpolated_positions,
    patch_rows_cols,
)


def local(p: torch.Tensor | None) -> torch.Tensor | None:
    """A parameter's local values (a replicated DTensor's replica; its gradient stays this
    rank's, every TP rank computing the same one from the same images)."""
    return p.to_local() if isinstance(p, DTensor) else p


def _linear(m: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if type(m) is not nn.Linear:  # a converted linear keeps its own forward
        return m(x)
    return F.linear(x, local(m.weight), local(m.bias))  # type: ignore[arg-type]


def _layer_norm(m: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, m.normalized_shape, local(m.weight), local(m.bias), m.eps)


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
        w, b = local(self.proj.weight), local(self.proj.bias)
        return F.conv3d(x, w, b, stride=self.proj.stride).flatten(1)  # type: ignore[arg-type]


@torch.compiler.disable
def frame_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int] | torch.Tensor
) -> torch.Tensor:
    """Bidirectional attention of ``q, k, v`` ``[N, H, Dh]`` within each run of ``lengths``
    rows (one frame of one image); ``[N, H, Dh]`` out. Eager under torch.compile: the number
    and the sizes of the frames change from batch to batch."""
    sizes = lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths
    outs = []
    for qs, ks, vs in zip(*(t.split(sizes) for t in (q, k, v)), strict=True):
        o = F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in (qs, ks, vs)))
        outs.append(o.transpose(0, 1))
    return torch.cat(outs) if outs else v


class VisionAttention(nn.Module):
    compile_graph_breaks = True  # frame_attention runs eagerly (distributed/compile.py)

    def __init__(self, a: VisionArgs) -> None:
        super().__init__()
        self.n_heads, self.head_dim = a.n_heads, a.head_dim
        self.qkv = nn.Linear(a.dim, 3 * a.dim)
        self.proj = nn.Linear(a.dim, a.dim)

    def forward(
        self, x: torch.Tensor, angles: torch.Tensor, lengths: list[int] | torch.Tensor
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = _linear(self.qkv, x).view(n, 3, self.n_heads, self.head_dim).unbind(1)
        q, k = rotate_halves(q, angles), rotate_halves(k, angles)
        out = frame_attention(q, k, v, lengths)
        return _linear(self.proj, out.reshape(n, self.n_heads * self.head_dim))


class VisionMLP(nn.Module):
    def __init__(self, a: VisionArgs) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(a.dim, a.intermediate_size)
        self.act = _act(a.hidden_act)
        self.linear_fc2 = nn.Linear(a.intermediate_size, a.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(self.linear_fc2, self.act(_linear(self.linear_fc1, x)))


class VisionBlock(nn.Module):
    """``h = x + attn(norm1(x)); out = h + mlp(norm2(h))``."""

    def __init__(self, a: VisionArgs) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(a.dim, eps=a.norm_eps)
        self.attn = VisionAttention(a)
        self.norm2 = nn.LayerNorm(a.dim, eps=a.norm_eps)
        self.mlp = VisionMLP(a)

    def forward(
        self, x: torch.Tensor, angles: torch.Tensor, lengths: list[int] | torch.Tensor
    ) -> torch.Tensor:
        h = x + self.attn(_layer_norm(self.norm1, x), angles, lengths)
        return h + self.mlp(_layer_norm(self.norm2, h))


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
        x = _layer_norm(self.norm, x).view(-1, self.merged)
        return _linear(self.linear_fc2, self.act(_linear(self.linear_fc1, x)))


class VisionTower(nn.Module):
    """``forward(pixel_values [N, patch_dim], grid_thw [images, 3]) -> [N / m^2, out_dim]``,
    the merged tokens of all images in order."""

    # Float8 leaves the tower's linears in high precision (distributed/float8.py): small, and
    # computed on local weights under tensor parallel (``local``), which Float8Linear is not.
    float8_exempt = True

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
        table = local(self.pos_embed.weight)
        assert table is not None
        x = x + interpolated_positions(table, grid_thw, m).to(x.dtype)
        rows, cols = patch_rows_cols(grid_thw, m)
        angles = rope_2d(rows.to(x.device), cols.to(x.device), a.head_dim, a.rope_theta)
        # a CPU tensor, not a list: a compiled block then does not guard on every frame's size
        lengths = torch.tensor(frame_lengths(grid_thw), dtype=torch.long)
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
