"""Checkpoint saves at ``checkpoint.interval`` and the preemption agreement
(``checkpoint/manager.py: step_end``, docs/checkpoint.md): the one hook that may stop the loop."""

from __future__ import annotations

from torchtitan.checkpoint.manager import CheckpointManager
from torchtitan.training.hooks.base import OffStepTime, StepHook


class CheckpointHook(StepHook):
    close_rank = 10  # after the watchdog's, before the profiler's; commits a background save

    def __init__(
        self, checkpointer: CheckpointManager, tokens_per_step: int, timing: OffStepTime
    ) -> None:
        self.checkpointer = checkpointer
        self.tokens_per_step = tokens_per_step  # global: the tokens seen, saved with the step
        self.timing = timing

    def after_step(self, step: int) -> str | None:
        with self.timing.during("checkpoint (save, commit, preemption agreement)"):
            stop = self.checkpointer.step_end(step, step * self.tokens_per_step)
        return "preemption signal" if stop else None

    def close(self) -> None:
        self.checkpointer.close()
