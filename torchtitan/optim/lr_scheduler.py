"""Learning-rate schedule: linear warm-up, optional stable phase, then linear/cosine/sqrt decay."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from torchtitan.config.job_config import LRScheduler


def lr_factor(step: int, schedule: LRScheduler, total_steps: int) -> float:
    """Multiplier of the peak lr used for optimizer step ``step`` (1-based).

    Warm-up rises linearly to 1.0 at step ``warmup_steps``; the remaining steps hold 1.0 for the
    first ``1 - decay_ratio`` of them (warmup-stable-decay) and then decay to ``min_lr_factor``,
    reaching it exactly at the last step.
    """
    s = schedule
    if s.warmup_steps > 0 and step <= s.warmup_steps:
        return s.warmup_start_factor + (1.0 - s.warmup_start_factor) * step / s.warmup_steps
    post_total = max(total_steps - s.warmup_steps, 1)
    decay_steps = round(s.decay_ratio * post_total)
    stable_steps = post_total - decay_steps
    post = step - s.warmup_steps
    if post <= stable_steps or decay_steps == 0:
        return 1.0
    progress = min((post - stable_steps) / decay_steps, 1.0)
    if s.decay_type == "linear":
        shape = 1.0 - progress
    elif s.decay_type == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        shape = 1.0 - math.sqrt(progress)
    return s.min_lr_factor + (1.0 - s.min_lr_factor) * shape


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, schedule: LRScheduler, total_steps: int
) -> LambdaLR:
    """``[lr_scheduler]`` over ``total_steps`` optimizer steps as a ``LambdaLR``."""
    # LambdaLR calls with 0 at construction (the lr of the first step) and +1 per scheduler.step().
    return LambdaLR(optimizer, lr_lambda=lambda index: lr_factor(index + 1, schedule, total_steps))
