"""The training loop's feature hooks (torchtitan/training/hooks/; docs/architecture.md, "Adding a
feature hook"): the order ``build_hooks`` gives them, the order they close in (every one, even
after an error), the time left out of the throughput, the gc schedule, the preemption stop."""

from __future__ import annotations

import gc
import time
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest

from torchtitan.config.job_config import JobConfig
from torchtitan.training.hooks.base import Closing, OffStepTime, StepHook, close_all
from torchtitan.training.hooks.build import build_hooks
from torchtitan.training.hooks.checkpoint import CheckpointHook
from torchtitan.training.hooks.comm import CommTimeoutHook
from torchtitan.training.hooks.faults import FaultsHook
from torchtitan.training.hooks.gc import GcHook
from torchtitan.training.hooks.periodic import PeriodicHook
from torchtitan.training.hooks.profiler import ProfilerHook
from torchtitan.training.hooks.watchdog import WatchdogHook


class Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, ...]] = []

    def timing(self) -> OffStepTime:
        return OffStepTime(
            lambda phase: self.events.append(("phase", phase)),
            lambda seconds: self.events.append(("excluded", f"{seconds:.2f}")),
        )


def test_build_hooks_gives_the_loops_order() -> None:
    """Before a step: gc, watchdog beat, faults; after it: validation, evaluation, profiler,
    checkpoint (which may stop the loop), the training timeout."""
    cfg = JobConfig()
    cfg.training = replace(cfg.training, gc_freq=50)
    some: Any = SimpleNamespace(should_validate=None, validate=None)
    some.should_evaluate = some.evaluate = None
    every = build_hooks(cfg, Log().timing(), some, some, (some, some, some), (some, 8), some)
    assert [type(h) for h in every] == [
        GcHook,
        WatchdogHook,
        FaultsHook,
        PeriodicHook,
        PeriodicHook,
        ProfilerHook,
        CheckpointHook,
        CommTimeoutHook,
    ]
    assert [h.phase for h in every if isinstance(h, PeriodicHook)] == [
        "validation",
        "evaluation (lm-eval tasks)",
    ]
    cfg.training = replace(cfg.training, gc_freq=0)
    least = build_hooks(cfg, Log().timing(), None, some, (None, None, some), None, some)
    assert [type(h) for h in least] == [FaultsHook, ProfilerHook, CommTimeoutHook]


class Recorder(StepHook):
    def __init__(self, name: str, log: list[str], rank: int, fail: bool = False) -> None:
        self.name, self.log, self.fail = name, log, fail
        self.close_rank = rank  # type: ignore[misc]

    def close(self) -> None:
        self.log.append(self.name)
        if self.fail:
            raise OSError(f"{self.name} failed")


def test_hooks_close_in_rank_order_and_all_close_after_an_error() -> None:
    """The trainer's close order: watchdog, checkpointer (whose background commit may fail: the
    others are closed anyway and its error surfaces), profiler, metrics, gc."""
    log: list[str] = []
    hooks: list[StepHook] = [
        Recorder("gc", log, GcHook.close_rank),
        Recorder("profiler", log, ProfilerHook.close_rank),
        Recorder("checkpoint", log, CheckpointHook.close_rank, fail=True),
        Recorder("watchdog", log, WatchdogHook.close_rank),
        Closing(lambda: log.append("metrics"), close_rank=80),
    ]
    with pytest.raises(OSError, match="checkpoint failed"):
        close_all(hooks)
    assert log == ["watchdog", "checkpoint", "profiler", "metrics", "gc"]


def test_checkpoint_hook_stops_on_preemption_and_excludes_its_time() -> None:
    calls: list[tuple[int, int]] = []

    class Checkpointer:
        def step_end(self, step: int, tokens_seen: int) -> bool:
            calls.append((step, tokens_seen))
            time.sleep(0.05)
            return step == 3

    log = Log()
    hook = CheckpointHook(Checkpointer(), 1024, log.timing())  # type: ignore[arg-type]
    assert hook.after_step(2) is None
    assert hook.after_step(3) == "preemption signal"
    assert calls == [(2, 2048), (3, 3072)]
    phases = [e for e in log.events if e[0] == "phase"]
    assert phases == [("phase", "checkpoint (save, commit, preemption agreement)")] * 2
    excluded = [float(e[1]) for e in log.events if e[0] == "excluded"]
    assert len(excluded) == 2 and all(0.04 <= s < 1.0 for s in excluded)


def test_a_failing_hook_excludes_no_time() -> None:
    log = Log()

    def validate(step: int) -> None:
        raise RuntimeError("bad batch")

    hook = PeriodicHook(lambda step: step % 2 == 0, validate, "validation", log.timing())
    assert hook.after_step(1) is None and log.events == []
    with pytest.raises(RuntimeError):
        hook.after_step(2)
    assert log.events == [("phase", "validation")]


def test_gc_hook_collects_on_its_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    collected: list[int] = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: collected.append(generation) or 0)
    hook = GcHook(3)
    try:
        hook.start(0)
        assert not gc.isenabled()
        for step in range(1, 10):
            hook.before_step(step)
        assert collected == [1, 1, 1]  # steps 3, 6, 9
    finally:
        hook.close()
    assert gc.isenabled()
