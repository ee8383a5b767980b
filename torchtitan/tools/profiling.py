"""torch.profiler traces and CUDA memory snapshots, every ``profile_freq`` steps, per rank.

Traces (``[profiling] enable_profiling``): a ``torch.profiler`` schedule repeats every
``profile_freq`` steps: ``wait`` steps, ``profiler_warmup`` steps profiled but thrown away (the
profiler's own start-up cost), then ``profiler_active`` steps recorded. The recorded steps end on
the multiples of ``profile_freq``; each rank writes a Chrome trace (open in Perfetto or
chrome://tracing) to ``<dump>/<save_traces_folder>/iteration_<step>/rank<r>_trace.json``. On CPU
the traces hold CPU operators (and gloo collectives); on CUDA, GPU kernels too.

Memory snapshots (``enable_memory_snapshot``, CUDA only; the config check refuses it elsewhere):
the caching allocator records every allocation with its stack
(``torch.cuda.memory._record_memory_history``) and a snapshot is written every ``profile_freq``
steps to ``<dump>/<save_memory_snapshot_folder>/iteration_<step>/rank<r>_memory_snapshot.pickle``,
and once more when the allocator runs out of memory (``.../oom/rank<r>_memory_snapshot.pickle``).
Drag a snapshot onto https://pytorch.org/memory_viz to see it.
"""

from __future__ import annotations

import os
import pickle
import warnings
from pathlib import Path
from typing import Any, Protocol

import torch

from torchtitan.tools.logging import logger

__all__ = ["MemorySnapshotter", "Profiling", "TraceProfiler"]

# Allocation events kept by the allocator's history (a ring buffer): ~100k is the recommended
# size for a few training steps; more costs host memory.
_MAX_ENTRIES = 100_000


class TraceProfiler:
    """A ``torch.profiler.profile`` on a repeating schedule; see the module docstring."""

    def __init__(
        self,
        folder: str | os.PathLike[str],
        *,
        profile_freq: int,
        warmup: int,
        active: int,
        rank: int,
        device_type: str,
    ) -> None:
        if not (warmup >= 0 and active >= 1 and warmup + active <= profile_freq):
            raise ValueError(
                f"profiler warm-up {warmup} + active {active} must fit in profile_freq {profile_freq}"
            )
        self.folder = Path(folder)
        self.rank = rank
        self.traces: list[Path] = []
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device_type == "cuda" and torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(
                wait=profile_freq - warmup - active, warmup=warmup, active=active
            ),
            on_trace_ready=self._save,
            record_shapes=True,
        )

    def _save(self, prof: torch.profiler.profile) -> None:
        out = self.folder / f"iteration_{prof.step_num}"
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"rank{self.rank}_trace.json"
        prof.export_chrome_trace(str(path))
        self.traces.append(path)
        logger.info(f"profiler trace of step {prof.step_num} written to {path}")

    def start(self, step: int) -> None:
        """Start before training step ``step + 1`` (``step`` steps are done)."""
        # The schedule counts from here, so a resumed run keeps the multiples of profile_freq
        # (set before start(), which enters the action of the current step).
        self._prof.step_num = step
        self._prof.current_action = self._prof.schedule(step)  # type: ignore[assignment]
        self._prof.start()

    def step(self) -> None:
        with warnings.catch_warnings():
            # Per-cycle traces are what we want; torch warns once that events are not kept.
            warnings.filterwarnings("ignore", message=".*Profiler clears events.*")
            self._prof.step()

    def stop(self) -> None:
        self._prof.stop()


class MemorySnapshotter:
    """CUDA allocator history, dumped every ``profile_freq`` steps and on OOM."""

    def __init__(self, folder: str | os.PathLike[str], *, profile_freq: int, rank: int) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CUDA memory snapshots need a CUDA device")
        self.folder = Path(folder)
        self.freq = profile_freq
        self.rank = rank
        self.snapshots: list[Path] = []
        self._step = 0

    def _dump(self, sub: str) -> Path:
        out = self.folder / sub
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"rank{self.rank}_memory_snapshot.pickle"
        snapshot: Any = torch.cuda.memory._snapshot()
        with open(path, "wb") as f:
            pickle.dump(snapshot, f)
        self.snapshots.append(path)
        return path

    def _on_oom(self, device: int, alloc: int, device_alloc: int, device_free: int) -> None:
        path = self._dump("oom")
        logger.error(
            f"CUDA out of memory after step {self._step} (asked for {alloc / 2**20:.1f} MiB, "
            f"{device_free / 2**20:.1f} MiB free): memory snapshot written to {path}"
        )

    def start(self, step: int) -> None:
        self._step = step
        torch.cuda.memory._record_memory_history(max_entries=_MAX_ENTRIES)
        attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
        if attach is not None:
            attach(self._on_oom)

    def step(self, step: int) -> None:
        self._step = step
        if step % self.freq == 0:
            path = self._dump(f"iteration_{step}")
            logger.info(f"memory snapshot of step {step} written to {path}")

    def stop(self) -> None:
        torch.cuda.memory._record_memory_history(enabled=None)


class ProfilingSettings(Protocol):
    """What ``Profiling`` reads: the ``[profiling]`` config section's fields (docs/observability.md)."""

    enable_profiling: bool
    save_traces_folder: str
    profile_freq: int
    profiler_warmup: int
    profiler_active: int
    enable_memory_snapshot: bool
    save_memory_snapshot_folder: str


class Profiling:
    """The trainer's single handle: ``start(step)`` before the loop, ``step(step)`` after each
    training step, ``stop()`` at the end. Does nothing when both features are off."""

    def __init__(
        self, dump_folder: str, settings: ProfilingSettings, rank: int, device_type: str
    ) -> None:
        s = settings
        self.trace: TraceProfiler | None = None
        self.memory: MemorySnapshotter | None = None
        if s.enable_profiling:
            self.trace = TraceProfiler(
                Path(dump_folder) / s.save_traces_folder,
                profile_freq=s.profile_freq,
                warmup=s.profiler_warmup,
                active=s.profiler_active,
                rank=rank,
                device_type=device_type,
            )
        if s.enable_memory_snapshot:
            self.memory = MemorySnapshotter(
                Path(dump_folder) / s.save_memory_snapshot_folder,
                profile_freq=s.profile_freq,
                rank=rank,
            )
        self._running = False

    def start(self, step: int) -> None:
        if self.trace is not None:
            self.trace.start(step)
        if self.memory is not None:
            self.memory.start(step)
        self._running = True

    def step(self, step: int) -> None:
        if not self._running:
            return
        if self.trace is not None:
            self.trace.step()
        if self.memory is not None:
            self.memory.step(step)

    def stop(self) -> None:
        if not self._running:
            return
        self._running = False
        if self.trace is not None:
            self.trace.stop()
        if self.memory is not None:
            self.memory.stop()
