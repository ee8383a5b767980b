"""Straggler flag on the cross-rank view (docs/observability.md, "Hangs and stragglers").

At each log step the metrics reduce, for each of step time and data time, the fastest and the
slowest rank (:mod:`torchtitan.tools.cross_rank`). A rank is a straggler on a metric when its
value exceeds the fastest rank's by more than ``margin`` (a fraction) and by more than
``MIN_GAP_S`` (so microsecond noise on tiny times is never flagged), at ``log_steps``
consecutive log steps. The flag costs nothing beyond the view's one all-reduce.

Step time is the wall time per step, which synchronous collectives make nearly equal on every
rank (the others wait for the slow one); data time is each rank's own wait for its batches, so a
slow input pipeline or disk is named precisely, and a rank slow in compute shows as every rank's
step time growing.
"""

from __future__ import annotations

from collections.abc import Mapping

from torchtitan.tools.logging import logger

__all__ = ["MIN_GAP_S", "StragglerFlag"]

MIN_GAP_S = 0.005
_METRICS = (("step_time_s", "step time"), ("data_time_s", "data time"))


class StragglerFlag:
    def __init__(self, margin: float, log_steps: int) -> None:
        self.margin, self.log_steps = margin, log_steps
        self._streak: dict[str, tuple[int, int]] = {}  # metric -> (rank, consecutive log steps)
        self.flagged: list[tuple[int, str, int]] = []  # (step, metric, rank) of every flag

    def update(self, step: int, view: Mapping[str, float | int]) -> str:
        """Feed one log step's view; returns the text for the log line ("" when none)."""
        text = ""
        for key, label in _METRICS:
            lo, hi = float(view[f"{key}_min"]), float(view[f"{key}_max"])
            rank = int(view[f"{key}_max_rank"])
            if hi > lo * (1.0 + self.margin) and hi - lo > MIN_GAP_S:
                prev_rank, n = self._streak.get(key, (rank, 0))
                n = n + 1 if prev_rank == rank else 1
                self._streak[key] = (rank, n)
                if n >= self.log_steps:
                    self.flagged.append((step, key, rank))
                    text += (
                        f"  STRAGGLER rank {rank}: {label} {hi:.3f}s vs fastest {lo:.3f}s "
                        f"for {n} log steps"
                    )
                    if n == self.log_steps:
                        logger.warning(
                            f"straggler: rank {rank}'s {label} ({hi:.3f} s) has exceeded the "
                            f"fastest rank's ({lo:.3f} s) by more than "
                            f"fault_tolerance.straggler_margin = {self.margin} for {n} log "
                            f"steps (step {step})"
                        )
            else:
                self._streak.pop(key, None)
        return text
