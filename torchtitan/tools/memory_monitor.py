"""Per-step memory with warm-up labelling and a leak detector
(docs/architecture.md, section 1, promise 4).

Memory rises during the first steps of a run (the allocator warms up, the optimizer creates its
state) and is flat afterwards. Looking at two log lines (say steps 1 and 10) that rise looks like
a leak; it is not. :class:`MemoryMonitor` therefore

- samples current and peak memory after *every* step (CUDA: allocated bytes from the caching
  allocator, plus reserved bytes, allocator retries and OOMs; CPU: process RSS, with an exact
  per-step peak on Linux, and the C heap in use), and can write each step to
  ``<dump>/memory/rank_<r>.jsonl``;
- labels the first ``warmup_steps`` steps of the process as warm-up, and logs once how much
  memory warm-up took;
- after warm-up, fits a trend to the last ``window`` steps of the *tracked* memory and warns
  only when it keeps growing (:func:`detect_growth`), naming the rank, the growth per step and
  the step it started.

The tracked memory is what live allocations hold: CUDA's allocated bytes, and on CPU the C heap
in use (glibc ``mallinfo2``; RSS where that is unavailable). CPU RSS is a poor leak signal: it
drifts up by tens of MiB over the first dozens of steps of a healthy run as the heap fragments,
while the heap in use stays flat to the KiB.

The trend test is built to ignore what is not a leak: noise (RSS moves by a few MiB from step to
step), a single jump (an allocator grabbing a new segment once) and a plateau reached late. It
needs all three of: a robust slope (Theil-Sen: the median of all pairwise slopes, so outliers do
not move it), a total rise over the window of at least ``min_growth_mib``, and a rise that keeps
going: the median of each quarter of the window is above the previous quarter's by at least half
of what the slope predicts and by more than the noise could explain (one jump raises only one
quarter boundary, and scatters widely around any straight line).
"""

from __future__ import annotations

import json
import math
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np

from torchtitan.tools.device_memory import DeviceMemoryMonitor, MemoryStats
from torchtitan.tools.logging import logger

__all__ = ["Growth", "LeakReport", "MemoryMonitor", "StepMemory", "detect_growth"]

_MIB = float(1 << 20)
_GIB = float(1 << 30)
_CHUNKS = 4


@dataclass(frozen=True)
class StepMemory:
    """Memory of one step: ``current`` at its end, ``peak`` during it (GiB), and its phase."""

    step: int
    current_gib: float
    peak_gib: float
    warmup: bool
    stats: MemoryStats
    tracked_gib: float
    """What the leak detector watches (see the module docstring)."""


@dataclass(frozen=True)
class Growth:
    """A memory trend found by :func:`detect_growth`."""

    bytes_per_step: float
    start_step: int
    """First step of the growth (estimated from the history; at worst the oldest step kept)."""
    last_step: int
    total_bytes: float
    """Growth from ``start_step`` to ``last_step`` along the fitted slope."""


@dataclass(frozen=True)
class LeakReport(Growth):
    rank: int = 0
    tracked: str = "allocated"
    flagged_step: int = 0
    """The step at which this leak was first reported."""

    def message(self) -> str:
        return (
            f"memory leak suspected on rank {self.rank}: {self.tracked} memory keeps growing by "
            f"{self.bytes_per_step / _MIB:.2f} MiB/step since step {self.start_step} "
            f"(+{self.total_bytes / _MIB:.1f} MiB by step {self.last_step}, after warm-up)"
        )


def theil_sen_slope(x: np.ndarray, y: np.ndarray) -> float:
    """Median of the pairwise slopes (y_j - y_i) / (x_j - x_i), i < j: robust to outliers."""
    i, j = np.triu_indices(len(x), k=1)
    dx = x[j] - x[i]
    keep = dx != 0
    if not keep.any():
        return 0.0
    return float(np.median((y[j] - y[i])[keep] / dx[keep]))


def _start_of_growth(x: np.ndarray, y: np.ndarray, slope: float) -> int:
    """The step where a rise began: the best (least absolute deviation) fit of a hinge, flat at
    the plateau level up to the start and rising at ``slope`` from it, over the history."""
    best_cost, best = math.inf, 0
    for c in range(len(y)):
        pre, post = y[:c], y[c:]
        ramp = slope * (x[c:] - x[c] + 1.0)
        level = float(np.median(pre)) if c > 0 else float(np.median(post - ramp))
        cost = float(np.abs(pre - level).sum() + np.abs(post - level - ramp).sum())
        if cost < best_cost:
            best_cost, best = cost, c
    return int(x[best])


def detect_growth(
    steps: list[int] | np.ndarray,
    values: list[float] | np.ndarray,
    window: int,
    min_growth: float,
    start_step: int | None = None,
) -> Growth | None:
    """A steady rise over the last ``window`` samples of ``values`` (bytes), or ``None``.

    ``steps``/``values`` is the post-warm-up history, oldest first; the samples before the
    window only serve to date the start of the growth (pass ``start_step`` when it is already
    known, for an ongoing leak). See the module docstring for the test.
    """
    x_all = np.asarray(steps, dtype=np.float64)
    y_all = np.asarray(values, dtype=np.float64)
    if window < 2 * _CHUNKS or len(y_all) < window:
        return None
    x, y = x_all[-window:], y_all[-window:]
    slope = theil_sen_slope(x, y)
    span = float(x[-1] - x[0])
    if slope <= 0 or slope * span < min_growth:
        return None
    size = window // _CHUNKS
    # Quarters counted from the end so the newest samples are always in the last quarter.
    bounds = [window - size * (_CHUNKS - k) for k in range(_CHUNKS + 1)]
    medians = [float(np.median(y[a:b])) for a, b in zip(bounds, bounds[1:])]
    # Each quarter must rise by half of what the slope predicts, and by more than the noise
    # could: twice the spread of a difference of two quarter medians, from the scatter around
    # the fitted line (a single jump scatters widely around a line and fails here).
    expected = slope * span / (window - 1) * size
    resid = y - slope * x
    sigma = 1.4826 * float(np.median(np.abs(resid - np.median(resid))))
    noise_floor = 2.0 * math.sqrt(2.0) * 1.2533 * sigma / math.sqrt(size)
    need = max(0.5 * expected, noise_floor)
    if any(b - a < need for a, b in zip(medians, medians[1:])):
        return None
    if start_step is None:
        start_step = min(_start_of_growth(x_all, y_all, slope), int(x[-1]))
    start = start_step
    last = int(x[-1])
    return Growth(slope, start, last, slope * (last - start + 1))


class MemoryMonitor:
    """Samples memory after every step, labels warm-up and watches for leaks (one rank).

    Call :meth:`end_step` once per step (it starts the next step's peak window), and
    :meth:`log_stats`/:meth:`log_fields` at log steps.
    """

    def __init__(
        self,
        device_monitor: DeviceMemoryMonitor,
        *,
        rank: int = 0,
        warmup_steps: int = 3,
        leak_window: int = 20,
        leak_min_growth_mib: float = 16.0,
        trace_path: str | Path | None = None,
    ) -> None:
        self.device = device_monitor
        self.rank = rank
        self.warmup_steps = warmup_steps
        self.leak_window = leak_window
        self.leak_min_growth = leak_min_growth_mib * _MIB
        self.steps_seen = 0
        self.last: StepMemory | None = None
        self.first: StepMemory | None = None
        self.last_warmup: StepMemory | None = None
        self.warmup_end: StepMemory | None = None
        """The reference after warm-up: the last warm-up step (or the first step without one)."""
        self.leak: LeakReport | None = None
        self.leak_warnings = 0
        self._quiet_steps = 0
        # Post-warm-up history: enough to date a leak that started a while before it was flagged.
        keep = max(4 * leak_window, 200)
        self._steps: deque[int] = deque(maxlen=keep)
        self._values: deque[float] = deque(maxlen=keep)
        self._window_peak: MemoryStats | None = None
        self._trace: IO[str] | None = None
        if trace_path is not None:
            path = Path(trace_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._trace = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())
        self.device.reset_peak()

    # ------------------------------------------------------------------ per step
    def in_warmup(self) -> bool:
        """Whether the last recorded step was a warm-up step."""
        return self.last is not None and self.last.warmup

    def end_step(self, step: int) -> StepMemory:
        """Record the step that just ended, then start the next step's peak window."""
        stats = self.device.stats()
        self.device.reset_peak()
        return self.record(step, stats)

    def record(self, step: int, stats: MemoryStats) -> StepMemory:
        """Fold one step's memory in (``end_step`` calls this; tests may call it directly).

        Warm-up is the first ``warmup_steps`` steps of this process, counted from the first
        step recorded (so a resumed run warms up again, as its allocator does)."""
        first_step = step if self.first is None else self.first.step
        warmup = step < first_step + self.warmup_steps
        tracked = stats.current_gib
        if stats.device_type != "cuda" and stats.heap_gib is not None:
            tracked = stats.heap_gib
        rec = StepMemory(step, stats.current_gib, stats.peak_gib, warmup, stats, tracked)
        self.steps_seen += 1
        self.last = rec
        if self.first is None:
            self.first = rec
        self._fold_window_peak(stats)
        if self._trace is not None:
            row = {"step": step, "warmup": warmup, **stats.as_dict(prefix="")}
            self._trace.write(json.dumps(row) + "\n")
        if warmup:
            self.last_warmup = rec
            return rec
        if self.warmup_end is None:
            self._end_warmup(rec)
        self._steps.append(step)
        self._values.append(rec.tracked_gib * _GIB)
        self._check_leak()
        return rec

    def _end_warmup(self, rec: StepMemory) -> None:
        self.warmup_end = self.last_warmup or rec
        first = self.first
        if self.last_warmup is None or first is None:
            return
        ref = self.last_warmup
        name = self.tracked_name
        logger.info(
            f"memory warm-up: steps {first.step}-{ref.step} took {name} memory from "
            f"{first.tracked_gib:.3f} to {ref.tracked_gib:.3f} GiB "
            f"({(ref.tracked_gib - first.tracked_gib) * 1024:+.1f} MiB), current "
            f"{first.current_gib:.3f} -> {ref.current_gib:.3f} GiB: allocator warm-up and "
            f"optimizer state, expected. From step {rec.step} on, steady growth of {name} memory "
            f"over {self.leak_window}-step windows is reported as a leak"
        )

    @property
    def tracked_name(self) -> str:
        """``allocated`` (CUDA), ``heap`` (CPU C heap) or ``rss``: what the detector watches."""
        s = self.last.stats if self.last is not None else None
        if s is None or s.device_type == "cuda":
            return "allocated"
        return "heap" if s.heap_gib is not None else "rss"

    def _check_leak(self) -> None:
        if self.leak_window <= 0:
            return
        growth = detect_growth(
            list(self._steps),
            list(self._values),
            self.leak_window,
            self.leak_min_growth,
            start_step=self.leak.start_step if self.leak is not None else None,
        )
        if growth is None:
            # The episode ends after a whole quiet window (one noisy window does not end it);
            # a later leak is then a new episode and warns again.
            self._quiet_steps += 1
            if self._quiet_steps >= self.leak_window:
                self.leak = None
            return
        self._quiet_steps = 0
        first_time = self.leak is None
        self.leak = LeakReport(
            growth.bytes_per_step,
            growth.start_step,
            growth.last_step,
            growth.total_bytes,
            self.rank,
            self.tracked_name,
            growth.last_step if first_time or self.leak is None else self.leak.flagged_step,
        )
        if first_time:
            self.leak_warnings += 1
            logger.warning(self.leak.message())

    def _fold_window_peak(self, s: MemoryStats) -> None:
        w = self._window_peak
        if w is None:
            self._window_peak = s
            return

        def mx(a: float | int | None, b: float | int | None) -> float | int | None:
            return None if a is None or b is None else max(a, b)

        self._window_peak = MemoryStats(
            device_type=s.device_type,
            current_gib=s.current_gib,
            peak_gib=max(w.peak_gib, s.peak_gib),
            reserved_gib=s.reserved_gib,
            peak_reserved_gib=mx(w.peak_reserved_gib, s.peak_reserved_gib),  # type: ignore[arg-type]
            num_alloc_retries=s.num_alloc_retries,
            num_ooms=s.num_ooms,
            rss_gib=s.rss_gib,
            peak_rss_gib=max(w.peak_rss_gib, s.peak_rss_gib),
            heap_gib=s.heap_gib,
        )

    # ------------------------------------------------------------------ log steps
    def log_stats(self) -> MemoryStats:
        """Current memory at the last step and the peaks over the steps since the previous call."""
        stats = self._window_peak if self._window_peak is not None else self.device.stats()
        self._window_peak = None
        if self._trace is not None:
            self._trace.flush()
        return stats

    def log_fields(self) -> tuple[dict[str, float | int | None], str]:
        """Scalars for the writers and the text for the log line: the warm-up label, the growth
        since warm-up, and a suspected leak."""
        last, ref = self.last, self.warmup_end
        warm = last is None or last.warmup
        since = None if warm or ref is None or last is None else last.tracked_gib - ref.tracked_gib
        leak = self.leak
        fields: dict[str, float | int | None] = {
            "memory/warmup": int(warm),
            "memory/growth_since_warmup_gib": since,
            "memory/leak_mib_per_step": leak.bytes_per_step / _MIB if leak else 0.0,
        }
        if warm:
            text = " [warm-up]"
        elif since is not None:
            text = f" [{self.tracked_name} {since * 1024:+.1f} MiB since warm-up]"
        else:
            text = ""
        if leak is not None:
            text += (
                f" [LEAK {leak.bytes_per_step / _MIB:+.2f} MiB/step since step {leak.start_step}]"
            )
        return fields, text

    def close(self) -> None:
        if self._trace is not None and not self._trace.closed:
            self._trace.close()
