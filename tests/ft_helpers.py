"""Launch helpers of the torchft end-to-end tests (tests/integration/test_fault_tolerance.py):
a lighthouse, replica groups as users start them (one ``run_train.sh`` each, in its own
process group, and SIGKILLed with all its ranks), and their logs."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tests.launcher import ROOT, free_port, run_train_env

STEP = re.compile(r"\[rank (\d+)[^\]]*\] step\s+(\d+)\s+loss\s+([0-9.]+)")
RECOVERED = re.compile(
    r"recovered live from a peer at step (\d+) \(was at step \d+\) in ([0-9.]+) s"
)
# tiny and fast: 2-layer debug model on short sequences, every step logged
ARGS = (
    "--training.seq_len", "32", "--training.local_batch_size", "2", "--metrics.log_freq", "1",
    "--metrics.enable_tensorboard", "false", "--lr_scheduler.warmup_steps", "2",
)  # fmt: skip


def lighthouse_cmd(port: int, min_replicas: int) -> list[str]:
    binary = Path(sys.executable).parent / "torchft_lighthouse"
    return [
        str(binary), "--bind", f"[::]:{port}", "--min_replicas", str(min_replicas),
        "--join_timeout_ms", "5000", "--heartbeat_timeout_ms", "1500",
    ]  # fmt: skip


class Lighthouse:
    """torchft's lighthouse binary on a free port; ``restart`` kills it and starts it again."""

    def __init__(self, folder: Path, min_replicas: int = 1) -> None:
        self.port, self.min_replicas, self.folder = free_port(), min_replicas, folder
        self.address = f"http://localhost:{self.port}"
        self.proc = self._start()

    def _start(self) -> subprocess.Popen:
        log_path = self.folder / "lighthouse.log"
        listening = log_path.read_text().count("Lighthouse listening") if log_path.exists() else 0
        with open(log_path, "a") as log:  # the child keeps its own fd
            proc = subprocess.Popen(
                lighthouse_cmd(self.port, self.min_replicas), stdout=log, stderr=log
            )
        end = time.monotonic() + 60
        while log_path.read_text().count("Lighthouse listening") == listening:
            assert time.monotonic() < end and proc.poll() is None, log_path.read_text()
            time.sleep(0.1)
        return proc

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def restart(self) -> None:
        self.kill()
        self.proc = self._start()


class Replica:
    """One replica group: ``run_train.sh`` with ``ngpu`` CPU ranks, its output in a file."""

    def __init__(
        self,
        folder: Path,
        replica_id: int,
        groups: int,
        ngpu: int,
        lighthouse: str,
        *args: str,
        fault: str = "",
    ) -> None:
        self.folder, self.replica_id = folder / f"replica{replica_id}", replica_id
        self.folder.mkdir(parents=True, exist_ok=True)
        self.cmd = [
            str(ROOT / "run_train.sh"), "--job.dump_folder", str(self.folder),
            "--fault_tolerance.enable", "--fault_tolerance.group_size", str(groups),
            "--fault_tolerance.replica_id", str(replica_id),
            "--fault_tolerance.lighthouse", lighthouse, *ARGS, *args,
        ]  # fmt: skip
        self.env = dict(run_train_env("all"), NGPU=str(ngpu), TORCHTITAN_DEVICE="cpu")
        self.env["OMP_NUM_THREADS"] = "1"
        self.env["TORCHTITAN_FAULT"] = fault  # e.g. "slow:seconds=0.2": paces the steps
        self.launches = 0
        self.start()

    def start(self) -> None:
        self.launches, self.killed = self.launches + 1, False
        self.log = self.folder / f"launch{self.launches}.log"
        with open(self.log, "w") as out:  # the child keeps its own fd
            self.proc = subprocess.Popen(
                self.cmd, cwd=self.folder, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: killpg reaches every rank
            )  # fmt: skip

    def sigkill(self) -> None:
        """SIGKILL the launcher and every rank (torchrun starts each rank in its own session,
        so the launcher's process group does not reach them)."""
        self.killed = True
        for pid in [*_descendants(self.proc.pid), self.proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait()

    def text(self) -> str:
        return "".join(p.read_text() for p in sorted(self.folder.glob("launch*.log")))

    def steps(self) -> list[tuple[int, float]]:
        """(step, loss) lines of rank 0, in the order logged, over every launch."""
        return [(int(m[2]), float(m[3])) for m in STEP.finditer(self.text()) if m[1] == "0"]

    def last_step(self) -> int:
        """The newest step rank 0 logged in the current launch (0 before the first)."""
        found = [int(m[2]) for m in STEP.finditer(self.log.read_text()) if m[1] == "0"]
        return found[-1] if found else 0

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid``, read from /proc (Linux)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def wait_for(cond: Callable[[], bool], timeout: float, what: str, logs: list[Replica]) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        failed = [r for r in logs if not r.killed and r.proc.poll() not in (None, 0)]
        if failed:
            raise AssertionError(f"{failed[0].log} exited early:\n{failed[0].text()[-4000:]}")
        time.sleep(0.2)
    tails = "\n".join(f"--- {r.log}\n{r.log.read_text()[-3000:]}" for r in logs)
    raise AssertionError(f"timed out ({timeout:.0f} s) waiting for {what}\n{tails}")
