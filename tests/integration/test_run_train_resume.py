"""What a user runs, end to end (the smoke tier runs it on each end of the torch window):
``./run_train.sh --checkpoint.enable`` on 2 ranks, SIGTERM mid-run (every rank saves, exit 0),
then the same command again, which resumes from that checkpoint. The two runs' losses together
equal an uninterrupted run's bit for bit (docs/checkpoint.md, "Preemption")."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.launcher import run_train_env
from tests.parity import SMALL_FP32

ROOT = Path(__file__).resolve().parents[2]
STEPS = 20
ARGS = ["--training.steps", str(STEPS), *SMALL_FP32, "--metrics.no-enable_tensorboard"]
ARGS += ["--checkpoint.enable", "--checkpoint.interval", "10"]


def _start(dump: Path, log: Path) -> subprocess.Popen:
    cmd = [str(ROOT / "run_train.sh"), "--job.dump_folder", str(dump), *ARGS]
    with log.open("w") as f:
        return subprocess.Popen(
            cmd, cwd=ROOT, env=run_train_env(), stdout=f, stderr=subprocess.STDOUT
        )


def _finish(proc: subprocess.Popen, log: Path) -> str:
    rc = proc.wait(timeout=600)
    out = log.read_text()
    assert rc == 0, out[-3000:]
    return out


def _losses(dump: Path) -> list[tuple[int, float]]:
    lines = (dump / "metrics" / "rank_0.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines)]


@pytest.mark.slow
@pytest.mark.smoke
def test_sigterm_then_relaunch_resumes_bitwise(tmp_path: Path) -> None:
    straight = tmp_path / "straight"
    _finish(_start(straight, tmp_path / "straight.log"), tmp_path / "straight.log")

    dump, log = tmp_path / "preempted", tmp_path / "preempted.log"
    proc = _start(dump, log)
    deadline = time.monotonic() + 300
    while "step      3 " not in log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)  # run_train.sh execs the launcher: torchrun's process
    out = _finish(proc, log)
    stopped = re.search(r"launch: signal SIGTERM: every rank stopped cleanly at step (\d+)", out)
    assert stopped, out[-3000:]
    at = int(stopped[1])
    assert 3 <= at < STEPS and (dump / "checkpoint" / f"step-{at}").is_dir(), out[-3000:]

    out = _finish(_start(dump, tmp_path / "resumed.log"), tmp_path / "resumed.log")
    assert f"resuming after step {at}" in out, out[-3000:]
    want, got = _losses(straight), _losses(dump)
    print(f"SIGTERM at step 3 -> saved step {at}, resumed to {STEPS}")
    print("uninterrupted:", " ".join(f"{s}:{x:.6f}" for s, x in want))
    print("SIGTERM+resume:", " ".join(f"{s}:{x:.6f}" for s, x in got))
    assert [s for s, _ in want] == list(range(1, STEPS + 1))
    assert got == want  # bit for bit (float equality of every step's loss)
