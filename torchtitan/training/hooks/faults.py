"""Test-only fault injection at the start of a step (``tools/fault_injection.py``: a hang, a
crash, a signal; the other faults act inside the step and the checkpointer)."""

from __future__ import annotations

from torchtitan.tools.fault_injection import Faults
from torchtitan.training.hooks.base import StepHook


class FaultsHook(StepHook):
    def __init__(self, faults: Faults) -> None:
        self.faults = faults

    def before_step(self, step: int) -> None:
        self.faults.at_step_start(step)
