"""Checks of the spike policy, the skip limit, the hang watchdog and the straggler flag
(docs/observability.md), before any process group exists."""

from __future__ import annotations

import math

from torchtitan.config.errors import ConfigError, require_int
from torchtitan.config.job_config import JobConfig


def _finite_positive(field: str, value: float, fix: str, allow_zero: bool = False) -> None:
    ok = isinstance(value, (int, float)) and math.isfinite(value)
    ok = ok and (value >= 0 if allow_zero else value > 0)
    if not ok:
        rule = "must be a finite number >= 0" if allow_zero else "must be a finite number > 0"
        raise ConfigError(field, value, rule, fix)


def validate_resilience(cfg: JobConfig) -> None:
    t, ft = cfg.training, cfg.fault_tolerance
    require_int(cfg, "training.spike_window", minimum=3)
    require_int(cfg, "training.spike_warmup", minimum=0)
    require_int(cfg, "training.max_consecutive_skips", minimum=0)
    _finite_positive("training.spike_threshold", t.spike_threshold, "use e.g. 6.0")
    if t.spike_policy == "rollback" and not cfg.checkpoint.enable:
        raise ConfigError(
            "training.spike_policy",
            t.spike_policy,
            "rolls back to the last checkpoint, so it needs checkpoint.enable",
            "add --checkpoint.enable (and a checkpoint.interval), or use skip_step",
        )
    _finite_positive(
        "fault_tolerance.watchdog_timeout_seconds",
        ft.watchdog_timeout_seconds,
        "use 0 to turn the watchdog off, or e.g. 60",
        allow_zero=True,
    )
    if 0 < cfg.comm.train_timeout_seconds <= ft.watchdog_timeout_seconds:
        raise ConfigError(
            "fault_tolerance.watchdog_timeout_seconds",
            ft.watchdog_timeout_seconds,
            f"must be shorter than comm.train_timeout_seconds ({cfg.comm.train_timeout_seconds}), "
            "or the collective timeout kills the job before the stacks are written",
            "lower it, e.g. to half of comm.train_timeout_seconds",
        )
    _finite_positive(
        "fault_tolerance.straggler_margin",
        ft.straggler_margin,
        "use 0 (off) or e.g. 0.5 for 50%",
        allow_zero=True,
    )
    require_int(cfg, "fault_tolerance.straggler_log_steps", minimum=1)
