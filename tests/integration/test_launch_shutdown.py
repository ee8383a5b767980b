"""``python -m torchtitan.launch --shutdown-timeout N``: after a forwarded SIGTERM the ranks get N
seconds, on every torch of the window (torch 2.11's torchrun has no such option: the launcher
gives its agent the timeout itself; torch_compat.TORCHRUN_SHUTDOWN_TIMEOUT).

Two stand-in ranks (plain python, no training) take ``SAVE_SECONDS`` to "save" after SIGTERM, then
report a clean stop as torchtitan.train does. A timeout longer than the save ends in exit 0; a
shorter one kills them (exit 128 + 15) where torch 2.11's fixed 30 s would have waited.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RANK = """
import os, signal, sys, time
from pathlib import Path
from torchtitan.launch import report_stop

def save_and_stop(signum, frame):
    time.sleep(float(os.environ["SAVE_SECONDS"]))
    report_stop("stopped", "7")
    sys.exit(0)

signal.signal(signal.SIGTERM, save_and_stop)
Path(os.environ["READY_DIR"], os.environ["LOCAL_RANK"]).touch()
while True:
    time.sleep(0.1)
"""


def _launch(tmp_path: Path, timeout: int, save_seconds: float) -> tuple[int, str, float]:
    """Start two stand-in ranks, SIGTERM the launcher once both run; (exit code, output,
    seconds from the signal to the launcher's exit)."""
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    ready = tmp_path / f"ready-{timeout}"
    ready.mkdir()
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        SAVE_SECONDS=str(save_seconds),
        READY_DIR=str(ready),
        OMP_NUM_THREADS="1",
    )
    cmd = [sys.executable, "-m", "torchtitan.launch", "--nproc_per_node", "2"]
    cmd += ["--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0", "--role", "rank"]
    cmd += ["--signals-to-handle", "SIGTERM", "--shutdown-timeout", str(timeout), str(script)]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = time.monotonic() + 120
    while len(list(ready.iterdir())) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    out, _ = proc.communicate(timeout=120)
    return proc.returncode, out, time.monotonic() - sent


@pytest.mark.smoke
def test_ranks_get_the_shutdown_timeout(tmp_path: Path) -> None:
    rc, out, waited = _launch(tmp_path, timeout=20, save_seconds=2)
    print(f"--shutdown-timeout 20, 2 s save: exit {rc} after {waited:.1f} s")
    assert rc == 0, out[-3000:]
    assert "launch: signal SIGTERM: every rank stopped cleanly at step 7" in out
    assert 2 <= waited < 20

    rc, out, waited = _launch(tmp_path, timeout=1, save_seconds=25)
    print(f"--shutdown-timeout 1, 25 s save: exit {rc} after {waited:.1f} s")
    assert rc == 128 + signal.SIGTERM, out[-3000:]
    assert "launch: signal SIGTERM: 0 of 2 local ranks stopped gracefully" in out
    assert waited < 15  # killed after 1 s, not torch 2.11's fixed 30 s
