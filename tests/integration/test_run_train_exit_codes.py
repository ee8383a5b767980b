"""run_train.sh exit codes (docs/errors.md, "Exit codes"): 2 and one message for a config error
(no rank started) or a data error met by the ranks; 0 after a graceful preemption save."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.launcher import run_train_env

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--training.seq_len", "64", "--training.local_batch_size", "2", "--metrics.log_freq", "1"]


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    cmd = [str(ROOT / "run_train.sh"), *args]
    return subprocess.run(
        cmd, cwd=cwd, env=run_train_env(), capture_output=True, text=True, timeout=600
    )


def test_config_error_exits_2_before_torchrun(tmp_path: Path) -> None:
    proc = _run(["--parallelism.tensor_parallel_degree", "3"], tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "parallelism.tensor_parallel_degree = 3" in proc.stderr
    assert "Traceback" not in out and "ChildFailedError" not in out and "[rank" not in out


@pytest.mark.slow
def test_data_error_in_the_ranks_exits_2_with_file_and_line(tmp_path: Path) -> None:
    # The preflight decodes the first MiB of each file; the bad line comes after it, so the
    # ranks meet it while reading and must report it the same way.
    data = tmp_path / "data.jsonl"
    good = json.dumps({"text": "lorem ipsum dolor sit amet " * 40}) + "\n"
    n = (1 << 20) // len(good) + 10
    data.write_text(good * n + "{not json\n")
    proc = _run(
        ["--job.dump_folder", str(tmp_path / "out"), "--training.dataset_path", str(data)]
        + SMALL
        + ["--training.steps", "100000"],
        tmp_path,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert f"training.dataset_path = '{data}'" in proc.stderr
    assert f"{data}, line {n + 1}: the record is not a JSON object" in proc.stderr
    assert "Traceback" not in out and "ChildFailedError" not in out


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_preemption_signal_saves_and_exits_0(tmp_path: Path, sig: signal.Signals) -> None:
    log = tmp_path / "log.txt"
    cmd = [str(ROOT / "run_train.sh"), "--job.dump_folder", str(tmp_path / "out")]
    cmd += SMALL + ["--training.steps", "100000", "--checkpoint.enable"]
    cmd += ["--checkpoint.interval", "100000"]
    with log.open("w") as f:
        proc = subprocess.Popen(
            cmd, cwd=tmp_path, env=run_train_env(), stdout=f, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + 300
        while "step      2 " not in log.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.5)
        proc.send_signal(sig)  # run_train.sh execs the launcher: this is torchrun's process
        rc = proc.wait(timeout=300)
    out = log.read_text()
    assert rc == 0, out[-3000:]
    assert "every rank stopped cleanly at step" in out
    assert "Traceback" not in out and "SignalException" not in out
    saved = sorted((tmp_path / "out" / "checkpoint").glob("step-*"))
    assert saved and all(p.name != "step-0" for p in saved), saved
