"""The vision tower in the planner's step time (``cost_model.py``; docs/vlm.md, "Planning"):
MFU's FLOPs per token (``planner/lora_memory.py: training_flops_per_token``) spread the tower's
work evenly over the devices; here it goes where it runs.

* **Replicated work**: every context-parallel rank encodes every image of its data-parallel
  group's batch, and every tensor-parallel rank too (the tower is not split), so a device runs
  ``cp x tp`` times its even share: ``vision_replicated = tokens per device x tower FLOPs per
  token x (cp * tp - 1) / (peak * mfu)``.
* **First-stage load**: under pipeline parallel the tower lives with the token embedding in the
  first stage; :func:`tower_stage_load` is its work in units of one decoder block's, which the
  cost model adds to the first unit's load (the stage imbalance then charges the slowest
  stage).
"""

from __future__ import annotations

from typing import Any

from torchtitan.models.common.vision.flops import tower_training_flops
from torchtitan.planner.layout import Layout

__all__ = ["tower_flops_per_token", "tower_stage_load", "vision_replicated_s"]


def tower_flops_per_token(cfg: Any, a: Any) -> float:
    """The tower's training FLOPs per token of the rows (one image of
    ``training.image_tokens_per_sample`` merged tokens per sample); 0 without a tower."""
    v = getattr(a, "vision", None)
    tokens = cfg.training.image_tokens_per_sample
    if v is None or tokens <= 0:
        return 0.0
    return tower_training_flops(v, tokens * v.spatial_merge_size**2) / cfg.training.seq_len


def vision_replicated_s(
    cfg: Any, a: Any, layout: Layout, tokens_device: float, peak: float
) -> float:
    """Seconds of tower work a device repeats beyond its even share (cp and tp replicate it)."""
    return tokens_device * tower_flops_per_token(cfg, a) * (layout.cp * layout.tp - 1) / peak


def tower_stage_load(cfg: Any, a: Any, layout: Layout, block_flops_fwd_token: float) -> float:
    """The first stage's tower work in decoder blocks: per device, the tower's FLOPs (``cp x
    tp`` replicated) over one block's training FLOPs (``3 x`` its forward, per token)."""
    block = 3 * block_flops_fwd_token / max(a.n_layers, 1) / layout.tp / layout.cp
    tower = tower_flops_per_token(cfg, a)
    return tower / block if block > 0 else 0.0
