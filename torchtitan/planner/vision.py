"""The vision tower in the FLOPs per token and in ``--job.explain`` (docs/vlm.md, "Planning").

A vision-language sample is a row of ``seq_len`` tokens, ``training.image_tokens_per_sample``
of them merged image tokens (counted as one image): the decoder runs every token of the row,
the tower runs ``image tokens x spatial_merge_size^2`` patches
(``models/common/vision/flops.py``). Spread over the row, the tower adds its training FLOPs
of one sample divided by ``seq_len`` to each token's count.

The families count ``6 x num_params(exclude_embedding=True, active=True)`` per token, and a
vision-language family's ``num_params`` holds the tower's parameters (memory counts them): that
would charge the tower once per text token. The tower's share of that term is taken out here
and replaced by its count per patch.
"""

from __future__ import annotations

from typing import Any

from torchtitan.config.job_config import JobConfig
from torchtitan.models.common.vision.flops import tower_training_flops

__all__ = ["vision_flops_per_token", "vision_lines"]


def vision_flops_per_token(cfg: JobConfig, args: Any) -> float:
    """What the tower changes in the family's FLOPs per token (0 without a tower)."""
    v = getattr(args, "vision", None)
    if v is None:
        return 0.0
    patches = cfg.training.image_tokens_per_sample * v.spatial_merge_size**2
    tower = tower_training_flops(v, patches) / cfg.training.seq_len
    return tower - 6 * v.num_params()


def vision_lines(cfg: JobConfig, args: Any, flops_per_token: int) -> list[str]:
    """The tower's parameters and its share of a step's FLOPs (no line without a tower)."""
    v = getattr(args, "vision", None)
    if v is None:
        return []
    t = cfg.training
    patches = t.image_tokens_per_sample * v.spatial_merge_size**2
    tower = tower_training_flops(v, patches)
    share = tower / (flops_per_token * t.seq_len) if flops_per_token else 0.0
    head = (
        f"vision tower: {v.num_params() / 1e6:,.1f} M parameters (in the memory estimate; "
        f"its activations are not), {v.depth} blocks of width {v.dim}"
    )
    if not patches:
        return [
            head,
            "  training.image_tokens_per_sample = 0: FLOPs per token and MFU count the "
            "decoder only; set it to the data's mean image tokens per sample",
        ]
    return [
        head,
        f"  {t.image_tokens_per_sample} image tokens per sample = {patches} patches: "
        f"{tower / 1e9:,.2f} GFLOP per sample, {share:.1%} of a step's FLOPs "
        f"(counted in MFU; training.image_tokens_per_sample)",
    ]
