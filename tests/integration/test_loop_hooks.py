"""A subclass adds a feature hook to the training loop (docs/architecture.md, "Adding a feature
hook"): it is told of every step in order, can stop the loop after a step (as a preemption
does: ``preempted_at``), and is closed with the others."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.launcher import run_ranks
from tests.parity import DEBUG_TOML


def _run(dump: str) -> dict[str, Any]:
    from torchtitan.preflight.validate import load_config
    from torchtitan.training.hooks.base import StepHook
    from torchtitan.training.trainer import Trainer

    events: list[str] = []

    class Record(StepHook):
        def __init__(self, name: str, stop_at: int | None = None) -> None:
            self.name, self.stop_at = name, stop_at

        def start(self, step: int) -> None:
            events.append(f"{self.name} start {step}")

        def before_step(self, step: int) -> None:
            events.append(f"{self.name} before {step}")

        def after_step(self, step: int) -> str | None:
            events.append(f"{self.name} after {step}")
            return "budget spent" if step == self.stop_at else None

        def end(self) -> None:
            events.append(f"{self.name} end")

        def close(self) -> None:
            events.append(f"{self.name} close")

    class Hooked(Trainer):
        def _build_hooks(self) -> list[StepHook]:
            return [*super()._build_hooks(), Record("a", stop_at=3), Record("b")]

        def train_step(self):  # type: ignore[no-untyped-def]
            events.append(f"step {self.step}")
            return super().train_step()

    cfg = load_config(
        ["--job.config_file", DEBUG_TOML, "--job.dump_folder", dump]
        + ["--training.steps", "10", "--training.seq_len", "16", "--training.local_batch_size", "2"]
        + ["--metrics.no-enable_tensorboard", "--training.gc_freq", "0"]
    )
    trainer = Hooked(cfg)
    try:
        trainer.train()
    finally:
        trainer.close()
    return {"events": events, "step": trainer.step, "preempted_at": trainer.preempted_at}


def test_a_subclass_hook_sees_every_step_and_stops_the_loop(tmp_path: Path) -> None:
    (out,) = run_ranks(_run, 1, str(tmp_path))
    steps = []
    for n in (1, 2, 3):
        steps += [f"a before {n}", f"b before {n}", f"step {n}", f"a after {n}"]
        steps += [f"b after {n}"] if n < 3 else []  # a asked to stop: b's after_step not run
    assert out["events"] == [
        "a start 0",
        "b start 0",
        *steps,
        "a end",
        "b end",
        "a close",
        "b close",
    ]
    assert out["step"] == 3 and out["preempted_at"] == 3
