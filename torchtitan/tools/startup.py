"""Time to first step: where a run's start-up goes (docs/performance.md, "Time to first step").

``mark(phase)`` closes a phase at the time of the call (its length: since the previous mark;
the first phase, ``imports``, starts when the process started, read from ``/proc``), and
``report()`` is the one log line the trainer writes after its first step. Compilation is lazy
(at the first step), so the first step's line also says how much of it was ``torch.compile``
(dynamo's own accounting, when the run compiled).
"""

from __future__ import annotations

import os
import time

_marks: list[tuple[str, float]] = []
_last: list[float] = []


def process_start() -> float:
    """``time.time()`` when this process started (Linux ``/proc``; else this module's import)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return _IMPORTED


_IMPORTED = time.time()


def mark(phase: str) -> float:
    """End ``phase`` now; returns its length in seconds."""
    now = time.time()
    start = _last[-1] if _last else process_start()
    _marks.append((phase, now - start))
    _last.append(now)
    return now - start


def phases() -> list[tuple[str, float]]:
    return list(_marks)


def compile_seconds() -> float:
    """Seconds torch.compile has spent so far in this process (0 when nothing compiled)."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:
        return 0.0
    return float(sum(compilation_time_metrics.get("_compile.compile_inner", [])))


def first_step() -> str | None:
    """At the end of this process's first step (fresh or resumed): ``mark("first step")`` and
    the report, once; None afterwards."""
    if any(name == "first step" for name, _ in _marks):
        return None
    mark("first step")
    return report()


def report() -> str:
    total = sum(s for _, s in _marks)
    parts = ", ".join(f"{name} {s:.2f}" for name, s in _marks)
    compiled = compile_seconds()
    extra = f" (of which torch.compile {compiled:.2f} s)" if compiled > 0 else ""
    return f"time to first step {total:.2f} s: {parts}{extra}"
