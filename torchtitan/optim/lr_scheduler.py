"""Learning-rate schedule: linear warm-up, optional stable phase, then linear/cosine/sqrt decay."""

from __future__ import annotations

import math
from functools import partial
from typing import Literal

import torch
from torch.optim.lr_scheduler import LambdaLR


def lr_factor(
    step: int,
    *,
    total_steps: int,
    warmup_steps: int,
    warmup_start_factor: float,
    decay_ratio: float,
    decay_type: Literal["linear", "cosine", "sqrt"],
    min_lr_factor: float,
) -> float:
    """Multiplier of the peak lr used for optimizer step ``step`` (1-based).

    Warm-up rises linearly to 1.0 at step ``warmup_steps``; the remaining steps hold 1.0 for the
    first ``1 - decay_ratio`` of them (warmup-stable-decay) and then decay to ``min_lr_factor``,
    reaching it exactly at the last step.
    """
    if warmup_steps > 0 and step <= warmup_steps:
        return warmup_start_factor + (1.0 - warmup_start_factor) * step / warmup_steps
    post_total = max(total_steps - warmup_steps, 1)
    decay_steps = round(decay_ratio * post_total)
    stable_steps = post_total - decay_steps
    post = step - warmup_steps
    if post <= stable_steps or decay_steps == 0:
        return 1.0
    progress = min((post - stable_steps) / decay_steps, 1.0)
    if decay_type == "linear":
        shape = 1.0 - progress
    elif decay_type == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        shape = 1.0 - math.sqrt(progress)
    return min_lr_factor + (1.0 - min_lr_factor) * shape


def _lambda(index: int, **kw) -> float:
    # LambdaLR calls with 0 at construction (the lr of the first step) and +1 per scheduler.step().
    return lr_factor(index + 1, **kw)


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer,
    *,
    total_steps: int,
    warmup_steps: int,
    warmup_start_factor: float,
    decay_ratio: float,
    decay_type: Literal["linear", "cosine", "sqrt"],
    min_lr_factor: float,
) -> LambdaLR:
    fn = partial(
        _lambda,
        total_steps=total_steps,
        warmup_steps=warmup_steps,
        warmup_start_factor=warmup_start_factor,
        decay_ratio=decay_ratio,
        decay_type=decay_type,
        min_lr_factor=min_lr_factor,
    )
    return LambdaLR(optimizer, lr_lambda=fn)
