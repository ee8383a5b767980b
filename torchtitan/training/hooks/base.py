"""The interface of the training loop's optional features (docs/architecture.md, "Adding a
feature hook").

A :class:`StepHook` is told when training starts and ends, before and after every step, and
when the trainer closes; every method does nothing unless a hook overrides it. The loop calls
the hooks in list order (``Trainer.hooks``, made by ``hooks/build.py: build_hooks``) and closes
them in ``close_rank`` order, each even if one before it raised.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar


class StepHook:
    """One optional feature of the loop. ``after_step`` may ask the loop to stop after this
    step by returning the reason (``"preemption signal"``); the hooks after it then do not run."""

    close_rank: ClassVar[int] = 50
    """Where ``close`` runs among the hooks' (lowest first)."""

    def start(self, step: int) -> None:
        """Training starts after step ``step`` (0, or the step a checkpoint resumed)."""

    def before_step(self, step: int) -> None:
        """Before step ``step``'s forwards."""

    def after_step(self, step: int) -> str | None:
        """After step ``step`` and its metrics; a reason to stop, or None."""
        return None

    def end(self) -> None:
        """The loop ended (its last step ran, or a hook asked to stop)."""

    def close(self) -> None:
        """The trainer closes (also after an error)."""


@dataclass(frozen=True)
class OffStepTime:
    """How a hook does work between steps: it names the phase to the hang watchdog and its time
    is left out of the throughput (``MetricsProcessor.exclude_time``)."""

    phase: Callable[[str], None]
    exclude_time: Callable[[float], None]

    @contextlib.contextmanager
    def during(self, phase: str) -> Iterator[None]:
        self.phase(phase)
        start = time.perf_counter()
        yield  # an exception propagates without the time being excluded, as it was inline
        self.exclude_time(time.perf_counter() - start)


class Closing(StepHook):
    """Only a close, at ``close_rank``: the trainer's own objects among the hooks' closes."""

    def __init__(self, close: Callable[[], None], close_rank: int) -> None:
        self._close = close
        self.close_rank = close_rank  # type: ignore[misc]

    def close(self) -> None:
        self._close()


def close_all(hooks: Sequence[StepHook]) -> None:
    """Close every hook in ``close_rank`` order; one that raises does not keep the others
    open (the first error propagates once they are all closed)."""
    ordered = sorted(hooks, key=lambda h: h.close_rank)
    if not ordered:
        return
    try:
        ordered[0].close()
    finally:
        close_all(ordered[1:])
