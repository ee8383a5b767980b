"""Peak FLOP/s of a device, for model FLOPs utilization (MFU).

MFU = achieved model FLOP/s / peak FLOP/s of the device, where the achieved figure counts only the FLOPs the
model's math needs (about ``6 * params * tokens`` for a training step, plus attention; activation recompute
is *not* counted) divided by the wall-clock time of the step. It says how much of the hardware's arithmetic
the training actually turns into model progress.

Two sources of the peak:

* ``datasheet_peak_flops``: the vendor's dense (no structured sparsity) tensor-core peak, looked up by the
  name ``torch.cuda.get_device_name()`` returns. ``None`` for CPUs and for any GPU not in the table: the
  library never guesses a peak.
* ``measure_matmul_peak_flops``: times a large square matmul on the device. That is the only peak a CPU has,
  and on a GPU it is a realistic ceiling (usually 60-85 % of the datasheet figure, because of clocks and
  power limits).

The table below holds values from the vendors' public datasheets, converted to dense where the datasheet
prints the with-sparsity figure (which is exactly twice the dense one). Cards whose datasheet figures are not
public or not certain (e.g. AWS's A10G) are deliberately left out and get ``None``.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import torch

__all__ = ["DATASHEET_PEAK_TFLOPS", "datasheet_peak_flops", "measure_matmul_peak_flops"]

# (regex searched in torch.cuda.get_device_name(), {dtype key: dense peak TFLOP/s}).
# First match wins, so more specific names come first. Keys: "bf16", "fp16", "fp8" (tensor cores),
# "tf32" (tensor cores, fp32 inputs), "fp32" (plain FP32 without tensor cores).
_H100_SXM = {"bf16": 989.4, "fp16": 989.4, "fp8": 1978.9, "tf32": 494.7, "fp32": 66.9}
_HOPPER_NVL = {"bf16": 835.5, "fp16": 835.5, "fp8": 1670.5, "tf32": 417.5, "fp32": 60.0}
DATASHEET_PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    # NVIDIA Hopper. An H100 name that says neither SXM/HBM3, PCIe nor NVL matches nothing (-> None).
    (r"\bH100\b.*\bNVL\b", _HOPPER_NVL),
    (
        r"\bH100\b.*\bPCIe\b",
        {"bf16": 756.5, "fp16": 756.5, "fp8": 1513.0, "tf32": 378.0, "fp32": 51.2},
    ),
    (r"\bH100\b.*(SXM|\bHBM3\b)", _H100_SXM),  # "NVIDIA H100 80GB HBM3"
    (r"\bGH200\b", _H100_SXM),
    (r"\bH200\b.*\bNVL\b", _HOPPER_NVL),
    (r"\bH200\b", _H100_SXM),  # H200 SXM: same compute as H100 SXM, more and faster memory
    # NVIDIA Ampere / Ada / Blackwell.
    (r"\bA100\b", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    (r"\bA10\b", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),  # not A10G
    (r"\bL40S\b", {"bf16": 362.05, "fp16": 362.05, "fp8": 733.0, "tf32": 183.0, "fp32": 91.6}),
    (r"\bB200\b", {"bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0}),
    # AMD Instinct.
    (r"\bMI300X\b", {"bf16": 1307.4, "fp16": 1307.4, "fp8": 2614.9, "tf32": 653.7, "fp32": 163.4}),
]

_FLOAT8_DTYPES = {
    getattr(torch, name)
    for name in (
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
    )
    if hasattr(torch, name)
}


def _tf32_enabled() -> bool:
    """Whether fp32 matmuls on CUDA may run on TF32 tensor cores.

    Reads the new per-backend setting (``torch.backends.cuda.matmul.fp32_precision``, which also reflects
    ``torch.set_float32_matmul_precision``); the legacy ``allow_tf32`` flag only where the new one is absent,
    because reading it raises once the new API has been used.
    """
    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", None)
    if precision is not None:
        return precision == "tf32"
    try:
        return bool(matmul.allow_tf32)
    except RuntimeError:
        return False


def _lookup(device_name: str) -> dict[str, float] | None:
    for pattern, peaks in DATASHEET_PEAK_TFLOPS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return peaks
    return None


def datasheet_peak_flops(
    device: torch.device | str, dtype: torch.dtype = torch.bfloat16
) -> float | None:
    """Dense datasheet peak of ``device`` for matmuls in ``dtype``, in FLOP/s, or ``None`` when unknown.

    ``None`` for CPU and other non-CUDA devices, for GPUs not in ``DATASHEET_PEAK_TFLOPS`` and for dtypes the
    table has no figure for. For ``torch.float32`` the TF32 figure is used when TF32 matmuls are allowed
    (``torch.backends.cuda.matmul.fp32_precision == "tf32"``, e.g. after
    ``torch.set_float32_matmul_precision("high")``), the plain FP32 figure otherwise.
    """
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    peaks = _lookup(torch.cuda.get_device_name(index))
    if peaks is None:
        return None
    if dtype == torch.bfloat16:
        key = "bf16"
    elif dtype == torch.float16:
        key = "fp16"
    elif dtype in _FLOAT8_DTYPES:
        key = "fp8"
    elif dtype == torch.float32:
        key = "tf32" if _tf32_enabled() and "tf32" in peaks else "fp32"
    else:
        return None
    tflops = peaks.get(key)
    return None if tflops is None else tflops * 1e12


def _make_matmul(n: int, dtype: torch.dtype, device: torch.device):
    """Return a zero-argument function doing one n x n x n matmul in ``dtype`` (2 * n**3 FLOPs)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    if dtype in _FLOAT8_DTYPES:
        a = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
        # _scaled_mm wants the second operand column-major.
        b = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype).t()
        scale = torch.ones((), device=device)
        return lambda: torch._scaled_mm(
            a, b, scale_a=scale, scale_b=scale, out_dtype=torch.bfloat16
        )
    a = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    return lambda: torch.mm(a, b, out=out)


def _measure_cuda(device: torch.device, dtype: torch.dtype, n: int, iters: int) -> float:
    with torch.cuda.device(device):
        matmul = _make_matmul(n, dtype, device)
        for _ in range(3):  # warm-up: cuBLAS heuristics, clocks ramping up
            matmul()
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            matmul()
        end.record()
        torch.cuda.synchronize()
        seconds = start.elapsed_time(end) / 1e3
    return 2.0 * n**3 * iters / seconds


def _measure_host_timed(
    device: torch.device,
    dtype: torch.dtype,
    n: int | None,
    iters: int | None,
    budget_s: float,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """CPU (and non-CUDA devices): timing by ``clock`` with a wall-clock budget; fastest matmul wins."""

    def sync() -> None:
        if device.type != "cpu" and hasattr(torch, "accelerator"):
            torch.accelerator.synchronize()

    def timed(matmul) -> float:
        t0 = clock()
        matmul()
        sync()
        return clock() - t0

    if n is None:
        # Grow n from 128 while one matmul of twice the size (8x the work) is predicted to fit in a tenth of
        # the budget, up to 2048; a slow dtype (e.g. emulated float8 on CPU) thus stays small and in budget.
        n = 128
        while n < 2048:
            probe = _make_matmul(n, dtype, device)
            timed(probe)  # warm-up
            if 8 * timed(probe) > budget_s / 10:
                break
            n *= 2
    matmul = _make_matmul(n, dtype, device)
    deadline = time.perf_counter() + budget_s
    timed(matmul)  # warm-up at the final size (thread pool, packing buffers)
    max_iters = iters if iters is not None else 50
    times: list[float] = []
    while len(times) < max_iters:
        times.append(timed(matmul))
        if iters is None and len(times) >= 2 and time.perf_counter() > deadline:
            break
    return 2.0 * n**3 / max(min(times), 1e-12)


def measure_matmul_peak_flops(
    device: torch.device | str,
    dtype: torch.dtype = torch.float32,
    size: int | None = None,
    iters: int | None = None,
    *,
    budget_s: float = 1.0,
    cpu_time: bool = False,
) -> float:
    """Measure the matmul throughput of ``device`` in ``dtype``, in FLOP/s (2 * n**3 per n x n matmul).

    CUDA: n = 8192 (``size`` overrides), 3 warm-up matmuls, then ``iters`` (default 50) timed with CUDA
    events; returns the mean rate. Float8 dtypes use ``torch._scaled_mm`` (needs float8 hardware).

    CPU: n is picked automatically in 128-2048 (2048 for fp32 on any recent CPU) so one matmul takes at most a tenth of ``budget_s``
    (``size`` overrides); after a warm-up, matmuls are timed until ``budget_s`` runs out (at least two; or
    exactly ``iters`` when given) and the rate of the fastest one is returned (the best case is the
    peak; slower ones were disturbed by other work on the machine). With the defaults the whole
    measurement takes about 1-2 s. On CPU this is the peak MFU is measured against.

    ``cpu_time`` (CPU only): time each matmul in process CPU time instead of wall-clock time, the
    peak per CPU-second this process gets; steady on a machine shared with other work when
    torch runs one thread (with more, OpenMP threads spinning at barriers count as CPU time).
    """
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                "measure_matmul_peak_flops: CUDA device requested but CUDA is unavailable"
            )
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return _measure_cuda(device, dtype, size or 8192, iters or 50)
    clock = time.process_time if cpu_time else time.perf_counter
    return _measure_host_timed(device, dtype, size, iters, budget_s, clock)


def mfu_peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """The peak FLOP/s MFU is measured against and where it comes from: a known GPU's
    datasheet, else a matmul timed here."""
    peak = datasheet_peak_flops(device, dtype)
    if peak is not None:
        return peak, "datasheet"
    return measure_matmul_peak_flops(device, dtype), "measured matmul"
