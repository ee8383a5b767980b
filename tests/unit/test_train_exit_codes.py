"""``python -m torchtitan.train`` turns the checkpoint guards' and the spike guards' errors into
one line and an exit code (docs/errors.md, "Exit codes"), never a traceback."""

from __future__ import annotations

import pytest

import torchtitan.train as train_entry
from torchtitan.checkpoint.safety import CheckpointSafetyError
from torchtitan.checkpoint.trust import UntrustedCheckpointError
from torchtitan.guards.spikes import TrainingAborted

ARGS = ["--job.config_file", "train_configs/debug_model.toml"]


class _Trainer:
    """Stands in for the Trainer: raises ``error`` while building or while training."""

    def __init__(self, error: Exception, when: str) -> None:
        self.error, self.when, self.closed = error, when, False
        self.step, self.preempted_at = 0, None
        if when == "build":
            raise error

    def train(self) -> None:
        raise self.error

    def close(self) -> None:
        self.closed = True


SAFETY = CheckpointSafetyError("every checkpoint under /x is invalid")
UNTRUSTED = UntrustedCheckpointError("step-4/.metadata asks for os.system")
ABORTED = TrainingAborted("3 consecutive steps skipped")


@pytest.mark.parametrize(
    ("error", "code", "prefix", "when"),
    [
        (SAFETY, 2, "checkpoint error:", "build"),  # resume found while building the trainer
        (UNTRUSTED, 2, "checkpoint error:", "build"),
        (UNTRUSTED, 2, "checkpoint error:", "train"),  # a rollback's load
        (ABORTED, 3, "training aborted:", "train"),
    ],
)
def test_guard_errors_are_one_line_with_their_exit_code(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    error: Exception,
    code: int,
    prefix: str,
    when: str,
) -> None:
    monkeypatch.setattr(train_entry, "Trainer", lambda cfg: _Trainer(error, when))
    assert train_entry.main(ARGS) == code
    err = capsys.readouterr().err.strip()
    assert err == f"{prefix} {error}"
    assert "Traceback" not in err
