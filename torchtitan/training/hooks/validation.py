"""The validation loss every ``validation.freq`` steps (``eval/validation_loss.py``), its time
left out of the throughput."""

from __future__ import annotations

from torchtitan.eval.validation_loss import Validator
from torchtitan.training.hooks.base import OffStepTime, StepHook


class ValidationHook(StepHook):
    def __init__(self, validator: Validator, timing: OffStepTime) -> None:
        self.validator = validator
        self.timing = timing

    def after_step(self, step: int) -> str | None:
        if self.validator.should_validate(step):
            with self.timing.during("validation"):
                self.validator.validate(step)
        return None
