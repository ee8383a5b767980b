"""The torch profiler traces and memory snapshots of ``[profiling]`` (``tools/profiling.py``)."""

from __future__ import annotations

from torchtitan.tools.profiling import Profiling
from torchtitan.training.hooks.base import StepHook


class ProfilerHook(StepHook):
    close_rank = 20  # after the checkpointer's

    def __init__(self, profiling: Profiling) -> None:
        self.profiling = profiling

    def start(self, step: int) -> None:
        self.profiling.start(step)

    def after_step(self, step: int) -> str | None:
        self.profiling.step(step)
        return None

    def close(self) -> None:
        self.profiling.stop()
