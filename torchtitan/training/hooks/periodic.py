"""Work every so many steps between steps: the validation loss (``validation.freq``,
``eval/validation_loss.py``) and lm-eval tasks (``eval.freq``, ``eval/harness.py``,
docs/evaluation.md). Its time is left out of the throughput."""

from __future__ import annotations

from collections.abc import Callable

from torchtitan.training.hooks.base import OffStepTime, StepHook


class PeriodicHook(StepHook):
    """``run(step)`` after the steps where ``due(step)``, named ``phase`` to the watchdog."""

    def __init__(
        self,
        due: Callable[[int], bool],
        run: Callable[[int], object],
        phase: str,
        timing: OffStepTime,
    ) -> None:
        self.due, self.run, self.phase, self.timing = due, run, phase, timing

    def after_step(self, step: int) -> str | None:
        if self.due(step):
            with self.timing.during(self.phase):
                self.run(step)
        return None
