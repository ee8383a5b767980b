"""The hang watchdog (``fault_tolerance.watchdog_timeout_seconds``, docs/observability.md): a
beat at the start of every step after the first, the phase between steps, paused when the
loop ends and closed first when the trainer closes."""

from __future__ import annotations

from torchtitan.tools.watchdog import Watchdog
from torchtitan.training.hooks.base import StepHook


class WatchdogHook(StepHook):
    close_rank = 0  # first: closing the others (a checkpoint commit) is not a hang

    def __init__(self, watchdog: Watchdog) -> None:
        self.watchdog = watchdog

    def before_step(self, step: int) -> None:
        if step > 1:  # the first step compiles and warms up: not watched
            self.watchdog.beat(step, "training step (forward, backward, collectives)")

    def end(self) -> None:
        self.watchdog.pause()

    def close(self) -> None:
        self.watchdog.close()
