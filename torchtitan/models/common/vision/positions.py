"""Where each patch and each token sits (docs/vlm.md):

* patches come in spatial-merge-block order (the ``m x m`` patches of one merged token next to
  each other, blocks in raster order), frame after frame; :func:`patch_rows_cols` gives each
  patch's row and column, which the tower's 2D RoPE rotates by and :func:`interpolated_positions`
  samples the learned table at;
* the decoder's MRoPE: three position rows (time, height, width) per token
  (:func:`mrope_positions`), equal for text, the grid of an image for its tokens; the rotated
  frequencies of a head are dealt to the three rows interleaved (:func:`mrope_freqs`);
* :func:`scatter_visual` puts the merged image tokens into the placeholder positions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def _grids(grid_thw: torch.Tensor) -> list[tuple[int, int, int]]:
    return [(int(t), int(h), int(w)) for t, h, w in grid_thw.tolist()]


def patch_rows_cols(grid_thw: torch.Tensor, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column (in patches) of every patch of every image, ``[N]`` each, in the order of
    ``pixel_values``."""
    rows, cols = [], []
    for t, h, w in _grids(grid_thw):
        r = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
        c = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
        rows.append(r.transpose(1, 2).reshape(-1).repeat(t))
        cols.append(c.transpose(1, 2).reshape(-1).repeat(t))
    if not rows:  # no image on this rank: the tower still runs (FSDP), on zero patches
        rows = cols = [torch.zeros(0, dtype=torch.long)]
    device = grid_thw.device
    return torch.cat(rows).to(device), torch.cat(cols).to(device)


def interpolated_positions(table: torch.Tensor, grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """The learned square position table (``[side * side, D]``) resampled bilinearly (corners
    aligned) to each image's ``h x w`` patch grid, in patch order: ``[N, D]``."""
    side = int(round(table.shape[0] ** 0.5))
    grid = table.view(side, side, -1).permute(2, 0, 1)[None]  # [1, D, side, side]
    out = []
    for t, h, w in _grids(grid_thw):
        img = F.interpolate(grid, size=(h, w), mode="bilinear", align_corners=True)[0]
        img = img.view(-1, h // merge, merge, w // merge, merge).permute(1, 3, 2, 4, 0)
        out.append(img.reshape(h * w, -1).repeat(t, 1))
    return torch.cat(out) if out else table[:0]


def frame_lengths(grid_thw: torch.Tensor) -> list[int]:
    """Patches of each frame of each image: the tower attends within one frame only."""
    return [h * w for t, h, w in _grids(grid_thw) for _ in range(t)]


def mrope_positions(
    tokens: torch.Tensor, image_token_id: int, grid_thw: torch.Tensor | None, merge: int
) -> torch.Tensor:
    """``[3, B, S]`` positions (time, height, width) of ``tokens`` ``[B, S]``. Text tokens
    count up, equal in all three rows; a run of ``image_token_id`` holds the images of
    ``grid_thw`` in order (each ``t * h * w / merge**2`` tokens): an image starting at ``p``
    gives its token at frame ``f``, merged row ``i``, column ``j`` the positions
    ``(p + f, p + i, p + j)``, and the text after it resumes at ``p + max(h, w) / merge``."""
    b, s = tokens.shape
    out = torch.empty(3, b, s, dtype=torch.long)
    grids = [] if grid_thw is None else _grids(grid_thw)
    next_image = 0
    is_image = (tokens == image_token_id).tolist()
    for row in range(b):
        pos, i = 0, 0
        while i < s:
            if not is_image[row][i]:
                out[:, row, i] = pos
                pos, i = pos + 1, i + 1
                continue
            if next_image == len(grids):
                raise ValueError(
                    f"row {row}, token {i}: an image placeholder (id {image_token_id}) with no "
                    f"image left ({len(grids)} images given): more placeholders than images"
                )
            t, h, w = grids[next_image]
            next_image += 1
            hm, wm = h // merge, w // merge
            ft, fh, fw = torch.meshgrid(
                torch.arange(t), torch.arange(hm), torch.arange(wm), indexing="ij"
            )
            n = t * hm * wm
            out[:, row, i : i + n] = torch.stack([ft, fh, fw]).reshape(3, n)[:, : s - i] + pos
            pos, i = pos + max(hm, wm), i + n
    return out.to(tokens.device)


def mrope_axes(half: int, sections: Sequence[int]) -> torch.Tensor:
    """For each of the ``half`` rotated frequencies, the position row it reads: 0 (time) by
    default, 1 (height) at indices ``1, 4, 7, ...`` below ``3 * sections[1]``, 2 (width) at
    ``2, 5, 8, ...`` below ``3 * sections[2]``."""
    axes = torch.zeros(half, dtype=torch.long)
    for axis in (1, 2):
        idx = torch.arange(axis, min(half, 3 * sections[axis]), 3)
        axes[idx] = axis
    return axes


def mrope_freqs(
    table: torch.Tensor, positions: torch.Tensor, sections: Sequence[int]
) -> torch.Tensor:
    """The complex RoPE factors ``[B, S, half]`` of :func:`mrope_positions` ``[3, B, S]`` from
    the 1-D table ``[max_seq_len, half]``: frequency ``k`` at the position of row
    ``mrope_axes[k]``."""
    half = table.shape[-1]
    axes = mrope_axes(half, sections).to(positions.device)
    pos = positions[axes]  # [half, B, S]: each frequency's position row
    cols = torch.arange(half, device=positions.device)
    return table[pos.permute(1, 2, 0), cols]


def scatter_visual(
    h: torch.Tensor, placeholders: torch.Tensor, visual: torch.Tensor
) -> torch.Tensor:
    """``h`` ``[B, S, D]`` with the rows where ``placeholders`` (``[B, S]`` bool) is set replaced,
    in order, by ``visual`` ``[N, D]`` (one row per placeholder)."""
    n = int(placeholders.sum())
    if n != visual.shape[0]:
        raise ValueError(
            f"{n} image placeholder tokens but {visual.shape[0]} image tokens from the vision "
            "tower: each image of grid t x h x w needs t*h*w/merge**2 placeholders"
        )
    mask = placeholders[..., None].expand_as(h)
    return h.masked_scatter(mask, visual.to(h.dtype))
