"""The image batch in the per-sample form that pipeline and context parallel can split
(docs/vlm.md, "Pipeline and context parallel"), for any family whose merged image tokens replace
placeholder tokens (qwen3_5_vl, kimi_k25).

The collated batch holds the patches of all its images in one ragged ``[N, patch_dim]`` tensor
(``data/vlm_dataset.py: collate``). A pipeline schedule splits every keyword input along the
batch dimension and context parallel splits ``[B, S, ...]`` inputs along the sequence, so
:func:`per_sample_images` turns the batch, from its whole sequences, into

* ``pixel_values`` ``[B, P, patch_dim]``: each row's patches, zero-padded to the longest row,
  when the batch goes through a pipeline schedule (``microbatched``); otherwise the collated
  ``[N, patch_dim]`` as it is (context parallel gives every cp rank all of it);
* ``grid_thw`` ``[B, I, 3]``: each row's image grids, zero rows for no image;
* ``visual_index`` ``[B, S]``: for a placeholder, which of its row's merged image tokens it
  receives (``-1`` for text), so a shard of the sequence finds its tokens.

The model undoes the padding (:func:`unpad_images`) and gathers each placeholder's token
(:func:`place_visual`). ``pool_frames``: a clip's frames are averaged into one set of merged
tokens (MoonViT: ``h * w / merge**2`` tokens an image) rather than merged in time (the Qwen
tower: ``t * h * w / merge**2``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from torchtitan.models.common.vision.positions import scatter_visual

__all__ = [
    "VisualScatter",
    "embed_with_images",
    "merged_tokens",
    "per_sample_images",
    "place_visual",
    "unpad_images",
]


def merged_tokens(grid_thw: torch.Tensor, merge: int, pool_frames: bool = False) -> torch.Tensor:
    """The merged image tokens of each ``grid_thw`` (``[..., 3]``) image (0 for a zero grid)."""
    size = grid_thw[..., 1:].prod(-1) if pool_frames else grid_thw.prod(-1)
    return size // merge**2


def _grids_per_row(placeholders: torch.Tensor, per_image: list[int]) -> list[list[int]]:
    """The indices of the images each row holds: the images in order, each row taking as many
    as its placeholder count (``per_image`` tokens an image)."""
    rows, nxt = [], 0
    for b, need in enumerate(placeholders.sum(1).tolist()):
        taken: list[int] = []
        while need > 0 and nxt < len(per_image):
            taken.append(nxt)
            need, nxt = need - per_image[nxt], nxt + 1
        if need != 0:
            raise ValueError(
                f"row {b}: its image placeholders do not add up to whole images of grid_thw "
                "(each image needs its merged token count of placeholders in one row)"
            )
        rows.append(taken)
    if nxt != len(per_image):
        raise ValueError(f"{len(per_image) - nxt} images of grid_thw have no placeholders")
    return rows


def per_sample_images(
    tokens: torch.Tensor,
    pixel_values: torch.Tensor,
    grid_thw: torch.Tensor,
    image_token_id: int,
    merge: int,
    microbatched: bool = True,
    pool_frames: bool = False,
) -> dict[str, torch.Tensor]:
    """The collated batch's images (``[N, patch_dim]``, ``[images, 3]``) for ``tokens``
    ``[B, S]`` in the per-sample form (module docstring; ``pixel_values`` padded per row only
    if ``microbatched``); ``ValueError`` (one line) when the placeholders and the images do
    not pair up row by row."""
    placeholders = tokens == image_token_id
    grid_thw = grid_thw.view(-1, 3).to(tokens.device)
    per_image = merged_tokens(grid_thw.cpu(), merge, pool_frames).tolist()
    rows = _grids_per_row(placeholders, per_image)
    patches = grid_thw.prod(-1).tolist()
    starts = [0]
    for n in patches:
        starts.append(starts[-1] + n)
    b, dim = tokens.shape[0], pixel_values.shape[-1]
    n_patches = [sum(patches[i] for i in row) for row in rows]
    pixels = pixel_values.new_zeros(b, max(n_patches, default=0), dim) if microbatched else None
    grids = grid_thw.new_zeros(b, max((len(r) for r in rows), default=0), 3)
    for r, row in enumerate(rows):
        if row:
            grids[r, : len(row)] = grid_thw[row[0] : row[-1] + 1]
            if pixels is not None:
                pixels[r, : n_patches[r]] = pixel_values[starts[row[0]] : starts[row[-1] + 1]]
    visual_index = torch.where(placeholders, placeholders.long().cumsum(1) - 1, -1)
    return {
        "pixel_values": pixel_values if pixels is None else pixels,
        "grid_thw": grids,
        "visual_index": visual_index,
    }


def unpad_images(
    pixel_values: torch.Tensor, grid_thw: torch.Tensor, merge: int, pool_frames: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample ``grid_thw`` ``[B, I, 3]`` with ``pixel_values`` padded per row
    (``[B, P, patch_dim]``) or collated (``[N, patch_dim]``) -> the ragged form the tower takes
    (``[N, patch_dim]``, ``[images, 3]``, rows in order) and the offset of each row's first
    merged token in the tower's output (``[B]``)."""
    size = grid_thw.prod(-1)  # [B, I]; 0 for padding
    tokens = merged_tokens(grid_thw, merge, pool_frames).sum(1)
    offsets = tokens.cumsum(0) - tokens
    if pixel_values.dim() == 3:
        keep = torch.arange(pixel_values.shape[1], device=size.device) < size.sum(1, keepdim=True)
        pixel_values = pixel_values[keep.to(pixel_values.device)]
    return pixel_values, grid_thw[size > 0], offsets


def place_visual(
    h: torch.Tensor,
    placeholders: torch.Tensor,
    visual: torch.Tensor,
    visual_index: torch.Tensor,
    offsets: torch.Tensor,
) -> torch.Tensor:
    """``h`` ``[B, S, D]`` with each placeholder's row replaced by its merged image token
    ``visual[offsets[b] + visual_index[b, s]]``. ``visual`` always joins the graph (an empty
    one too, or one no placeholder of this shard reads), so the tower's backward, and the
    FSDP collectives in it, run on every rank."""
    pad = visual.shape[0]  # the index of an extra zero row read by text positions
    rows = (offsets[:, None].to(visual_index.device) + visual_index).masked_fill(~placeholders, pad)
    table = torch.cat([visual.to(h.dtype), h.new_zeros(1, h.shape[-1])])
    return torch.where(placeholders[..., None], table[rows], h)


class VisualScatter(nn.Module):
    """The merged image tokens written over the placeholders' embeddings (``h`` unchanged
    without images): in order (the collated form) or by ``visual_index`` (the per-sample form).
    A module, with no parameters, so a family's parallel plan can place its output: under
    tensor parallel its whole rows are cut onto the sequence shard the first block expects."""

    def forward(
        self,
        h: torch.Tensor,
        placeholders: torch.Tensor,
        visual: torch.Tensor | None,
        visual_index: torch.Tensor | None = None,
        offsets: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if visual is None:
            return h
        if visual_index is None:  # the collated form: whole rows, images in order
            return scatter_visual(h, placeholders, visual)
        assert offsets is not None
        return place_visual(h, placeholders, visual, visual_index, offsets)


def embed_with_images(
    embed: nn.Module,
    scatter: nn.Module,
    encode: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    tokens: torch.Tensor,
    image_token_id: int,
    images: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
    merge: int,
    pool_frames: bool = False,
) -> torch.Tensor:
    """Token embeddings with ``encode``'s merged image tokens at the placeholders, the shared
    first step of the vision-language families: ``images`` is (``pixel_values``, ``grid_thw``,
    ``visual_index``) in the collated form (no ``visual_index``) or the per-sample one."""
    pixel_values, grid_thw, visual_index = images
    placeholders = tokens == image_token_id
    h = embed(tokens)
    if pixel_values is None:
        if bool(placeholders.any()):
            raise ValueError(
                f"{int(placeholders.sum())} image placeholder tokens (id {image_token_id}) "
                "but no pixel_values"
            )
        return scatter(h, placeholders, None)
    if grid_thw is None:
        raise ValueError("pixel_values given without grid_thw")
    if visual_index is None:  # the collated form: whole rows, images in order
        if grid_thw.dim() != 2 or pixel_values.dim() != 2:
            raise ValueError("per-sample pixel_values / grid_thw need visual_index")
        return scatter(h, placeholders, encode(pixel_values, grid_thw))
    pixels, grids, offsets = unpad_images(pixel_values, grid_thw, merge, pool_frames=pool_frames)
    return scatter(h, placeholders, encode(pixels, grids), visual_index, offsets)
