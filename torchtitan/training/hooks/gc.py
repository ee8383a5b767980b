"""Python's garbage collector on a fixed schedule (``training.gc_freq``): automatic collection
off while training, a generation-1 collection every ``gc_freq`` steps, so that no rank pauses
at a random moment and the others wait for it in the next collective."""

from __future__ import annotations

import gc

from torchtitan.training.hooks.base import StepHook


class GcHook(StepHook):
    close_rank = 90  # last: collection comes back on once everything else is closed

    def __init__(self, freq: int) -> None:
        self.freq = freq

    def start(self, step: int) -> None:
        gc.disable()

    def before_step(self, step: int) -> None:
        if step % self.freq == 0:
            gc.collect(1)

    def close(self) -> None:
        gc.enable()
