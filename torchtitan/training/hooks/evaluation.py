"""lm-eval tasks on the model in training every ``eval.freq`` steps (``eval/harness.py``,
docs/evaluation.md), their time left out of the throughput."""

from __future__ import annotations

from torchtitan.eval.harness import Evaluator
from torchtitan.training.hooks.base import OffStepTime, StepHook


class EvaluationHook(StepHook):
    def __init__(self, evaluator: Evaluator, timing: OffStepTime) -> None:
        self.evaluator = evaluator
        self.timing = timing

    def after_step(self, step: int) -> str | None:
        if self.evaluator.should_evaluate(step):
            with self.timing.during("evaluation (lm-eval tasks)"):
                self.evaluator.evaluate(step)
        return None
