"""A per-rank hang watchdog (docs/observability.md, "Hangs and stragglers").

The trainer calls :meth:`Watchdog.beat` at the start of every step and :meth:`Watchdog.phase`
when it enters a part of the step that may wait on other ranks (the step's collectives, the
metrics all-reduce, a checkpoint save, validation). A daemon thread checks the time since the
last beat; once it exceeds ``fault_tolerance.watchdog_timeout_seconds`` it writes, once per
step, ``<dump_folder>/<watchdog_folder>/rank_<r>_step_<s>.txt`` holding:

- the step, the phase it is in (what it is waiting for) and how long it has been there;
- the Python stack of every thread (``faulthandler``, which works while the main thread is
  blocked inside a C++ collective) and the same stacks with thread names
  (``sys._current_frames``);
- on CUDA with NCCL, the NCCL flight recorder's trace of recent collectives
  (``rank_<r>_step_<s>.nccl_trace``), when this torch exposes it.

Every rank runs its own watchdog with the same timeout: a rank stuck in its step stops beating,
and the ranks waiting for it in a collective stop beating too, so all of them dump before
``comm.train_timeout_seconds`` (which must be longer; validated) kills the job.
:func:`configure_flight_recorder` sets torch's flight-recorder variables before the process
group exists, so NCCL also dumps its trace on a collective timeout.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
import traceback
from pathlib import Path

from torchtitan.tools.logging import logger

__all__ = ["Watchdog", "configure_flight_recorder"]

# Old and new names of torch's flight-recorder variables (torch 2.11-2.15 read one or the other).
_FR_BUFFER = ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE")
_FR_FILE = ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_FR_DUMP_TEMP_FILE")


def configure_flight_recorder(dump_dir: Path, buffer_entries: int = 2000) -> None:
    """Turn on the NCCL flight recorder with a dump on collective timeout into ``dump_dir``
    (call before the process group is created; variables already set by the user win)."""
    dump_dir.mkdir(parents=True, exist_ok=True)
    for name in _FR_BUFFER:
        os.environ.setdefault(name, str(buffer_entries))
    for name in _FR_FILE:
        os.environ.setdefault(name, str(dump_dir / "nccl_trace_rank_"))
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")


def _nccl_trace() -> bytes | None:
    """The flight recorder's trace (a pickle of plain data), where torch exposes one."""
    try:
        import torch

        c10d = torch._C._distributed_c10d
        dump = getattr(c10d, "_dump_nccl_trace", None)
        if dump is None or not torch.cuda.is_initialized():
            return None
        return bytes(dump())
    except Exception:  # noqa: BLE001 - a diagnostic must not take the job down
        return None


class Watchdog:
    """See the module docstring. ``poll_s`` is how often the thread looks at the clock."""

    def __init__(self, timeout_s: float, dump_dir: Path, rank: int, poll_s: float = 0.5) -> None:
        self.timeout_s, self.dump_dir, self.rank = timeout_s, dump_dir, rank
        self.poll_s = min(poll_s, timeout_s / 4)
        self.dumps: list[Path] = []
        self._step = 0
        self._phase = "not started"
        self._since = time.monotonic()
        self._phase_since = self._since
        self._armed = False
        self._dumped_step = -1
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="titan-watchdog", daemon=True)
        self._thread.start()

    def beat(self, step: int, phase: str = "training step") -> None:
        """A step starts: restart the clock."""
        now = time.monotonic()
        with self._lock:
            self._step, self._phase, self._since, self._phase_since = step, phase, now, now
            self._armed = True

    def phase(self, phase: str) -> None:
        """The step enters ``phase`` (the clock keeps running from the step's start)."""
        with self._lock:
            self._phase, self._phase_since = phase, time.monotonic()

    def pause(self) -> None:
        """Stop watching until the next beat (e.g. after the last step)."""
        with self._lock:
            self._armed = False

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            with self._lock:
                late = self._armed and time.monotonic() - self._since > self.timeout_s
                step, phase = self._step, self._phase
                waited, in_phase = (
                    time.monotonic() - self._since,
                    time.monotonic() - self._phase_since,
                )
                due = late and self._dumped_step != step
                if due:
                    self._dumped_step = step
            if due:
                self._dump(step, phase, waited, in_phase)

    def _dump(self, step: int, phase: str, waited: float, in_phase: float) -> None:
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        path = self.dump_dir / f"rank_{self.rank}_step_{step}.txt"
        names = {t.ident: t.name for t in threading.enumerate()}
        with open(path, "w") as f:
            f.write(
                f"rank {self.rank}: step {step} has run for {waited:.1f} s "
                f"(fault_tolerance.watchdog_timeout_seconds = {self.timeout_s})\n"
                f"waiting in: {phase} (for {in_phase:.1f} s)\n"
                f"pid {os.getpid()}, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n\n"
                "== faulthandler: every thread ==\n"
            )
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
            f.write("\n== Python stacks by thread ==\n")
            for ident, frame in sys._current_frames().items():
                f.write(f"\nthread {names.get(ident, '?')} ({ident}):\n")
                f.write("".join(traceback.format_stack(frame)))
        self.dumps.append(path)
        trace = _nccl_trace()
        if trace is not None:
            (self.dump_dir / f"rank_{self.rank}_step_{step}.nccl_trace").write_bytes(trace)
        logger.error(
            f"watchdog: step {step} has run for {waited:.1f} s (> {self.timeout_s} s) in "
            f"'{phase}'; stacks of every thread written to {path}"
        )
