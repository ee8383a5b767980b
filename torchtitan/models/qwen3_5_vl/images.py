"""The image batch of qwen3_5_vl in the per-sample form that pipeline and context parallel can
split (docs/vlm.md, "Pipeline and context parallel"): the shared form
(``models/common/vision/images.py``: ``pixel_values``, ``grid_thw``, ``visual_index``) plus

* ``mrope_positions`` ``[B, S, 3]``: the time/height/width positions of the whole sequence,
  which a pipeline stage without the tokens and a context-parallel shard cannot recompute.

Without a pipeline the collated ``[N, patch_dim]`` patches stay as they are, which saves the
padding (1.9x the patches on the test data: a text-only row pads a whole row).
"""

from __future__ import annotations

import torch

from torchtitan.models.common.vision import images as shared
from torchtitan.models.common.vision import mrope_positions
from torchtitan.models.common.vision.images import place_visual, unpad_images

__all__ = ["per_sample_images", "place_visual", "unpad_images"]


def per_sample_images(
    tokens: torch.Tensor,
    pixel_values: torch.Tensor,
    grid_thw: torch.Tensor,
    image_token_id: int,
    merge: int,
    microbatched: bool = True,
) -> dict[str, torch.Tensor]:
    """The shared per-sample form of the batch's images plus the whole sequence's MRoPE
    positions (module docstring); ``ValueError`` (one line) when the placeholders and the
    images do not pair up row by row."""
    out = shared.per_sample_images(
        tokens, pixel_values, grid_thw, image_token_id, merge, microbatched
    )
    grids = grid_thw.view(-1, 3).to(tokens.device)
    positions = mrope_positions(tokens, image_token_id, grids, merge)
    out["mrope_positions"] = positions.permute(1, 2, 0).contiguous()
    return out
