"""The learning-rate schedule's shape, step by step (optim/lr_scheduler.py)."""

from __future__ import annotations

import pytest
import torch

from torchtitan.config.job_config import LRScheduler
from torchtitan.optim.lr_scheduler import build_lr_scheduler, lr_factor


def test_warmup_stable_decay_reaches_the_floor_at_the_last_step() -> None:
    s = LRScheduler(warmup_steps=2, decay_ratio=0.5, decay_type="linear", min_lr_factor=0.1)
    got = [lr_factor(step, s, total_steps=10) for step in range(1, 11)]
    # warm-up 0.5, 1.0; 8 steps after it: 4 stable, 4 decaying linearly to 0.1
    want = [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 0.775, 0.55, 0.325, 0.1]
    assert got == pytest.approx(want)


@pytest.mark.parametrize(("decay_type", "mid"), [("cosine", 0.55), ("sqrt", 0.363604)])
def test_decay_shapes_halfway(decay_type: str, mid: float) -> None:
    s = LRScheduler(warmup_steps=2, decay_ratio=0.5, decay_type=decay_type, min_lr_factor=0.1)  # type: ignore[arg-type]
    assert lr_factor(8, s, total_steps=10) == pytest.approx(mid, abs=1e-6)


def test_scheduler_sets_the_first_step_lr_and_steps_along() -> None:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    sched = build_lr_scheduler(opt, LRScheduler(warmup_steps=4), total_steps=8)
    lrs = []
    for _ in range(8):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.5, 1.0, 1.5, 2.0, 1.5, 1.0, 0.5, 0.0])
