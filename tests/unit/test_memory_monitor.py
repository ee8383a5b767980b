"""Memory monitor (docs/architecture.md, section 1, promise 4): warm-up labelling, the leak detector, and the cross-rank packing.

Synthetic memory series stand in for a device: exact, fast and free of the noise of the machine
running the tests. The end-to-end checks on the real trainer are in
tests/distributed/test_observability.py.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from torchtitan.tools.cross_rank import decode, encode
from torchtitan.tools.device_memory import DeviceMemoryMonitor, MemoryStats
from torchtitan.tools.memory_monitor import MemoryMonitor, detect_growth, theil_sen_slope

MIB = 1 << 20
GIB = 1 << 30
WINDOW = 20


def _stats(current_mib: float, peak_mib: float | None = None) -> MemoryStats:
    cur = current_mib / 1024
    peak = (peak_mib if peak_mib is not None else current_mib) / 1024
    return MemoryStats("cpu", cur, peak, None, None, None, None, cur, peak)


def _monitor(tmp_path: Path | None = None, **kw: object) -> MemoryMonitor:
    args: dict = dict(rank=3, warmup_steps=3, leak_window=WINDOW, leak_min_growth_mib=16.0)
    args.update(kw)
    trace = None if tmp_path is None else tmp_path / "memory" / "rank_3.jsonl"
    return MemoryMonitor(DeviceMemoryMonitor("cpu"), trace_path=trace, **args)


def _warmup_then(n: int, rng: np.random.Generator, noise_mib: float = 3.0) -> list[float]:
    """Steps 1-3 rise (activations, grads, optimizer state), then a noisy plateau at 600 MiB."""
    return [500.0, 560.0, 600.0] + list(600.0 + rng.normal(0.0, noise_mib, n - 3))


def test_theil_sen_ignores_outliers() -> None:
    x = np.arange(30, dtype=float)
    y = 2.0 * x
    y[[3, 17, 25]] += 1000.0  # three wild samples do not move the median slope
    assert theil_sen_slope(x, y) == pytest.approx(2.0)


def test_training_like_series_stays_quiet(caplog: pytest.LogCaptureFixture) -> None:
    """Warm-up growth, noise, outliers, a one-off jump and a plateau: never a leak."""
    rng = np.random.default_rng(0)
    series = _warmup_then(300, rng)
    series[50] += 80.0  # a transient spike (one step)
    series[120:] = [v + 40.0 for v in series[120:]]  # one jump: the allocator grabs a segment
    series[200:208] = [v + 3.0 * i for i, v in enumerate(series[200:208])]  # rise to a plateau
    series[208:] = [v + 24.0 for v in series[208:]]
    mon = _monitor()
    with caplog.at_level(logging.WARNING, logger="torchtitan"):
        for step, mib in enumerate(series, start=1):
            mon.record(step, _stats(mib))
            assert mon.leak is None, f"false leak at step {step}: {mon.leak}"
    assert mon.leak_warnings == 0
    assert not [r for r in caplog.records if "leak" in r.getMessage()]


@pytest.mark.parametrize("rate_mib, noise_mib", [(4.0, 0.0), (4.0, 3.0), (1.5, 1.0)])
def test_injected_leak_is_flagged_within_a_window(
    rate_mib: float, noise_mib: float, caplog: pytest.LogCaptureFixture
) -> None:
    rng = np.random.default_rng(1)
    start = 60
    series = _warmup_then(200, rng, noise_mib)
    series[start - 1 :] = [v + rate_mib * (i + 1) for i, v in enumerate(series[start - 1 :])]
    mon = _monitor()
    flagged_at = None
    with caplog.at_level(logging.WARNING, logger="torchtitan"):
        for step, mib in enumerate(series, start=1):
            mon.record(step, _stats(mib))
            if mon.leak is not None and flagged_at is None:
                flagged_at = step
    assert flagged_at is not None, "the leak was never flagged"
    print(f"leak of {rate_mib} MiB/step from step {start} flagged at step {flagged_at}: {mon.leak}")
    assert flagged_at <= start + WINDOW + 2, f"flagged only at step {flagged_at}"
    assert mon.leak is not None
    assert mon.leak.bytes_per_step / MIB == pytest.approx(rate_mib, rel=0.25)
    assert abs(mon.leak.start_step - start) <= 4, mon.leak
    assert mon.leak.rank == 3
    warnings = [r.getMessage() for r in caplog.records if "leak" in r.getMessage()]
    assert len(warnings) == 1, warnings  # one warning per leak episode, not one per step
    assert "rank 3" in warnings[0] and "MiB/step" in warnings[0] and "since step" in warnings[0]
    fields, text = mon.log_fields()
    assert fields["memory/leak_mib_per_step"] == pytest.approx(rate_mib, rel=0.25)
    assert "LEAK" in text


def test_slow_leak_below_threshold_is_not_reported() -> None:
    """0.5 MiB/step is 10 MiB per 20-step window: under the 16 MiB threshold."""
    series = [600.0 + 0.5 * i for i in range(100)]
    assert detect_growth(list(range(100)), [v * MIB for v in series], WINDOW, 16 * MIB) is None
    growth = detect_growth(list(range(100)), [v * MIB for v in series], WINDOW, 8 * MIB)
    assert growth is not None and growth.bytes_per_step / MIB == pytest.approx(0.5)


def test_warmup_steps_are_labelled(tmp_path: Path) -> None:
    mon = _monitor(tmp_path)
    labels = []
    for step, mib in enumerate([500.0, 560.0, 600.0, 601.0, 600.0], start=1):
        mon.record(step, _stats(mib, mib + 50))
        fields, text = mon.log_fields()
        labels.append((fields["memory/warmup"], text))
    assert [w for w, _ in labels] == [1, 1, 1, 0, 0]
    assert all("[warm-up]" in t for _, t in labels[:3])
    assert "[warm-up]" not in labels[3][1] and "[rss +1.0 MiB since warm-up]" in labels[3][1]
    assert mon.warmup_end is not None and mon.warmup_end.step == 3
    mon.close()
    rows = [
        json.loads(line) for line in (tmp_path / "memory" / "rank_3.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["warmup"] for r in rows] == [True, True, True, False, False]
    assert rows[0]["current_gib"] == pytest.approx(500 / 1024)
    assert rows[0]["peak_gib"] == pytest.approx(550 / 1024)


def test_seed_scenario_logged_at_steps_1_and_10_is_warmup_not_leak(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The seed's users saw memory at step 1 and step 10 only and took the rise for a leak.
    Sampled every step, the rise is all in the warm-up steps: step 1 is labelled warm-up, step 10
    shows no growth since warm-up, and nothing warns."""
    mon = _monitor()
    series = [420.0, 590.0, 610.0, 611.0, 609.0, 610.0, 612.0, 610.0, 611.0, 610.0]
    logged = {}
    with caplog.at_level(logging.INFO, logger="torchtitan"):
        for step, mib in enumerate(series, start=1):
            mon.record(step, _stats(mib))
            if step in (1, 10):  # log_freq 10: the only two lines the seed's users saw
                logged[step] = (mon.log_stats(), *mon.log_fields())
    (s1, f1, t1), (s10, f10, t10) = logged[1], logged[10]
    assert s10.current_gib - s1.current_gib == pytest.approx(190 / 1024)  # the rise they saw
    assert f1["memory/warmup"] == 1 and "[warm-up]" in t1
    assert f10["memory/warmup"] == 0 and f10["memory/leak_mib_per_step"] == 0.0
    assert f10["memory/growth_since_warmup_gib"] == pytest.approx(0.0, abs=2 / 1024)
    assert "LEAK" not in t10 and mon.leak is None
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "leak suspected" in m]
    (warm,) = [m for m in messages if m.startswith("memory warm-up")]
    assert "steps 1-3" in warm and "+190.0 MiB" in warm and "expected" in warm


def test_window_peak_between_log_steps() -> None:
    mon = _monitor()
    for step, (cur, peak) in enumerate([(500, 700), (600, 900), (600, 650)], start=1):
        mon.record(step, _stats(cur, peak))
    stats = mon.log_stats()
    assert stats.peak_gib == pytest.approx(900 / 1024)  # the largest per-step peak since the log
    assert stats.current_gib == pytest.approx(600 / 1024)  # the last step's current
    mon.record(4, _stats(600, 620))
    assert mon.log_stats().peak_gib == pytest.approx(620 / 1024)  # a new window


def test_cpu_peak_is_exact_within_a_step() -> None:
    """On Linux the per-step CPU peak comes from the kernel's high-water mark, reset each step, so
    a transient 128 MiB tensor freed before the end of the step still shows up in that step."""
    dev = DeviceMemoryMonitor("cpu")
    if not dev._os_peak_is_windowed:
        pytest.skip("the kernel's RSS high-water mark cannot be reset here")
    mon = MemoryMonitor(dev, warmup_steps=0, leak_window=0)
    mon.end_step(1)
    big = torch.ones(32 * MIB)  # 128 MiB, touched
    del big
    rec = mon.end_step(2)
    assert rec.peak_gib - rec.current_gib > 0.1, rec
    rec3 = mon.end_step(3)
    assert rec3.peak_gib - rec3.current_gib < 0.05, rec3  # reset: the spike belongs to step 2


def test_cpu_heap_in_use_tracks_tensors_not_fragmentation() -> None:
    """On CPU the detector watches the C heap in use: a live tensor adds its bytes, freeing it
    takes them back (RSS need not come back)."""
    dev = DeviceMemoryMonitor("cpu")
    before = dev.stats().heap_gib
    if before is None:
        pytest.skip("no glibc mallinfo2 here: the detector falls back to RSS")
    kept = [torch.ones(4 * MIB) for _ in range(4)]  # 4 x 16 MiB
    during = dev.stats().heap_gib
    del kept
    after = dev.stats().heap_gib
    assert during is not None and after is not None
    assert (during - before) * 1024 == pytest.approx(64, abs=2)
    assert abs(after - before) * 1024 < 2
    mon = MemoryMonitor(dev, warmup_steps=0, leak_window=0)
    assert mon.end_step(1).tracked_gib == pytest.approx(mon.last.stats.heap_gib)  # type: ignore[union-attr]
    assert mon.tracked_name == "heap"


def test_cross_rank_packing_roundtrip() -> None:
    names = ["step_time_s", "memory_peak_gib"]
    scales = [1e6, float(1 << 20)]
    per_rank = {0: (0.51, 1.20), 1: (0.73, 1.10), 2: (0.50, 1.35), 3: (0.52, 1.10)}
    encoded = [
        encode({n: (v, s) for n, v, s in zip(names, vals, scales)}, rank)
        for rank, vals in per_rank.items()
    ]
    reduced = [max(col) for col in zip(*encoded)]  # what the MAX all-reduce computes
    view = decode(names, scales, reduced)
    assert view["step_time_s_max"] == pytest.approx(0.73) and view["step_time_s_max_rank"] == 1
    assert view["step_time_s_min"] == pytest.approx(0.50) and view["step_time_s_min_rank"] == 2
    assert view["memory_peak_gib_max"] == pytest.approx(1.35, abs=1e-6)
    assert view["memory_peak_gib_max_rank"] == 2
    assert view["memory_peak_gib_min"] == pytest.approx(1.10, abs=1e-6)
    assert view["memory_peak_gib_min_rank"] in (1, 3)
