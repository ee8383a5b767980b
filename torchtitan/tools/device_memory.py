"""Per-step device memory statistics, on CUDA and on CPU.

On CUDA the numbers come from the caching allocator: ``current``/``peak`` are *allocated* bytes (what tensors
use), ``reserved``/``peak_reserved`` are what the allocator holds from the driver (what ``nvidia-smi`` roughly
shows), and ``num_alloc_retries``/``num_ooms`` count allocator cache flushes and out-of-memory errors (a
non-zero retry count means the allocator is under pressure and steps slow down).

On CPU there is no allocator to ask (``torch.accelerator`` memory stats raise there), so the process resident
set size (RSS, from ``psutil``) stands in: ``current`` is the RSS now and ``peak`` the largest RSS since the last
``reset_peak()``. On Linux that peak is exact: ``reset_peak()`` resets the kernel's RSS high-water mark
(``VmHWM``, by writing ``5`` to ``/proc/self/clear_refs``) and the peak is read back from it, so a spike that
comes and goes inside a step is seen. Elsewhere (or where ``clear_refs`` is not writable) the peak is the
largest RSS seen by ``sample()``/``stats()``, only as good as the sampling (once per step). ``peak_rss`` is the
process's high-water mark since start (the kernel's values before each reset are remembered).

On CPU with glibc, ``heap`` is what the C heap holds *in use* now (``mallinfo2``: allocated chunks plus
``mmap``-ed blocks): the bytes of live tensors and other native allocations, without the memory freed but kept
by the allocator. It is CPU's counterpart of CUDA's allocated bytes: exact and flat when nothing leaks, where
RSS drifts with heap fragmentation (the leak detector in ``memory_monitor`` watches it on CPU).

Every device also reports ``rss``/``peak_rss`` for the process, so host-memory growth (e.g. a data loader
leak) is visible on GPU runs too. Devices other than CUDA and CPU get the CPU treatment (process RSS).

Typical use, once per training step::

    monitor = DeviceMemoryMonitor(device)
    for step in ...:
        monitor.reset_peak()
        train_step()
        monitor.sample()
        if log_step:
            writer.log(monitor.stats().as_dict(), step)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import sys
from dataclasses import dataclass, fields
from typing import Any

import psutil
import torch

__all__ = ["MemoryStats", "DeviceMemoryMonitor", "device_memory_capacity_gib"]

_GIB = float(1 << 30)


@dataclass
class MemoryStats:
    """One snapshot of memory use. All sizes in GiB (2**30 bytes).

    ``reserved_gib``, ``peak_reserved_gib``, ``num_alloc_retries`` and ``num_ooms`` exist only on CUDA and
    are ``None`` elsewhere.
    """

    device_type: str
    current_gib: float
    peak_gib: float
    reserved_gib: float | None
    peak_reserved_gib: float | None
    num_alloc_retries: int | None
    num_ooms: int | None
    rss_gib: float
    peak_rss_gib: float
    heap_gib: float | None = None
    """CPU with glibc only: bytes in use in the C heap (see the module docstring)."""

    def as_dict(self, prefix: str = "memory/") -> dict[str, float | int]:
        """Flat ``{prefix + field: value}`` for metric writers: numbers only, ``None`` and non-finite values
        left out (so is ``device_type``, which is not a number)."""
        out: dict[str, float | int] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None or isinstance(value, str):
                continue
            if isinstance(value, float) and not math.isfinite(value):
                continue
            out[prefix + f.name] = value
        return out


def _rss_bytes(process: psutil.Process) -> int:
    return int(process.memory_info().rss)


def _reset_os_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark (Linux >= 4.0); False where that is not possible."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


_mallinfo2: Any = None  # glibc's mallinfo2, looked up once; False when unavailable


def _heap_in_use_bytes() -> int | None:
    """Bytes in use in the C heap (glibc >= 2.33 ``mallinfo2``: in-use chunks + mmap-ed blocks)."""
    global _mallinfo2
    if _mallinfo2 is None:
        _mallinfo2 = False
        if sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                fn = libc.mallinfo2
                fn.restype = _MallInfo2
                _mallinfo2 = fn
            except (OSError, AttributeError):
                pass
    if _mallinfo2 is False:
        return None
    info = _mallinfo2()
    return int(info.uordblks + info.hblkhd)


def _os_peak_rss_bytes() -> int | None:
    """The process's RSS high-water mark since start, as the OS reports it, or ``None``."""
    if sys.platform.startswith("linux"):
        try:
            with open("/proc/self/status", encoding="ascii", errors="replace") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024  # reported in kB
        except (OSError, ValueError, IndexError):
            pass
    try:
        import resource

        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        # ru_maxrss is in kilobytes on Linux and in bytes on macOS.
        return int(maxrss) if sys.platform == "darwin" else int(maxrss) * 1024
    except (ImportError, OSError, ValueError):
        return None


class DeviceMemoryMonitor:
    """Reports current and peak memory of ``device`` (see the module docstring for what each number is).

    ``sample()`` is cheap (one ``psutil`` call and, on Linux, one read of ``/proc/self/status``) and is meant
    to be called once per step; ``stats()`` samples too, so ``peak >= current`` always holds.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._is_cuda = self.device.type == "cuda" and torch.cuda.is_available()
        if self._is_cuda and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._process = psutil.Process()
        self._peak_rss_sampled = 0  # max RSS sampled since the last reset_peak()
        self._peak_rss_ever = 0  # max RSS seen since construction (sampled, or VmHWM before resets)
        self._os_peak_is_windowed = False  # VmHWM was reset by the last reset_peak()
        self.reset_peak()

    @property
    def device_type(self) -> str:
        return "cuda" if self._is_cuda else self.device.type

    def reset_peak(self) -> None:
        """Start a new peak window (e.g. at the start of each step)."""
        if self._is_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        rss = _rss_bytes(self._process)
        # Remember the process high-water mark before resetting the kernel's.
        self._peak_rss_ever = max(self._peak_rss_ever, rss, _os_peak_rss_bytes() or 0)
        self._peak_rss_sampled = rss
        self._os_peak_is_windowed = _reset_os_peak_rss()

    def sample(self) -> int:
        """Read the current RSS, fold it into the peaks and return it (bytes)."""
        rss = _rss_bytes(self._process)
        if rss > self._peak_rss_sampled:
            self._peak_rss_sampled = rss
        if rss > self._peak_rss_ever:
            self._peak_rss_ever = rss
        return rss

    def stats(self) -> MemoryStats:
        rss = self.sample()
        os_peak = _os_peak_rss_bytes() or 0
        peak_rss_gib = max(self._peak_rss_ever, os_peak) / _GIB
        heap = None if self._is_cuda else _heap_in_use_bytes()
        # Peak RSS since reset_peak(): the kernel's exact value where it was reset, else sampled.
        window_peak = max(self._peak_rss_sampled, os_peak if self._os_peak_is_windowed else 0)
        if self._is_cuda:
            dev = self.device
            cuda_stats = torch.cuda.memory_stats(dev)
            return MemoryStats(
                device_type="cuda",
                current_gib=torch.cuda.memory_allocated(dev) / _GIB,
                peak_gib=torch.cuda.max_memory_allocated(dev) / _GIB,
                reserved_gib=torch.cuda.memory_reserved(dev) / _GIB,
                peak_reserved_gib=torch.cuda.max_memory_reserved(dev) / _GIB,
                num_alloc_retries=int(cuda_stats.get("num_alloc_retries", 0)),
                num_ooms=int(cuda_stats.get("num_ooms", 0)),
                rss_gib=rss / _GIB,
                peak_rss_gib=peak_rss_gib,
            )
        return MemoryStats(
            device_type=self.device_type,
            current_gib=rss / _GIB,
            peak_gib=window_peak / _GIB,
            reserved_gib=None,
            peak_reserved_gib=None,
            num_alloc_retries=None,
            num_ooms=None,
            rss_gib=rss / _GIB,
            peak_rss_gib=peak_rss_gib,
            heap_gib=None if heap is None else heap / _GIB,
        )

    def as_dict(self, prefix: str = "memory/") -> dict[str, float | int]:
        """Shorthand for ``self.stats().as_dict(prefix)``."""
        return self.stats().as_dict(prefix)


def _cgroup_limit_bytes() -> int | None:
    """The memory limit of this process's cgroup (containers), or ``None`` when there is none."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path, encoding="ascii") as f:
                raw = f.read().strip()
        except OSError:
            continue
        if raw.isdigit():
            limit = int(raw)
            # cgroup v1 reports "no limit" as a huge number close to 2**63.
            if limit < (1 << 62):
                return limit
    return None


def device_memory_capacity_gib(device: torch.device | str) -> float:
    """Total memory of ``device`` in GiB: the GPU's memory on CUDA; on CPU (and other devices) the host's
    physical memory, or the container's cgroup limit when that is lower."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.get_device_properties(index).total_memory / _GIB
    total = int(psutil.virtual_memory().total)
    limit = _cgroup_limit_bytes()
    if limit is not None:
        total = min(total, limit)
    return total / _GIB
