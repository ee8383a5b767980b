"""The benchmark scripts run end to end and print the documented JSON (docs/performance.md).

Each script runs as a subprocess, as the README runs it, for a couple of steps of a tiny setting
of the debug model (seq_len 64, batch 2), and its last JSON line is checked: documented keys,
positive throughput, MFU in (0, 100] percent (or null for a datasheet peak on CPU), internal
consistency (step time x tokens/s = tokens per step; MFU = FLOPs/token x tokens/s / peak).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from torchtitan.metrics.processor import MetricsProcessor

ROOT = Path(__file__).resolve().parents[2]
SEQ, BATCH = 64, 2


def _tiny(dump: Path) -> list[str]:
    return [
        "--job.config_file",
        "train_configs/debug_model.toml",
        "--job.dump_folder",
        str(dump),
        "--training.seq_len",
        str(SEQ),
        "--training.local_batch_size",
        str(BATCH),
        "--training.mixed_precision_param",
        "float32",
        "--metrics.log_freq",
        "1",
        "--metrics.no-enable_tensorboard",
    ]


def _run(script: str, args: list[str]) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    res = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert res.returncode == 0, f"{script} exit {res.returncode}:\n{res.stderr[-3000:]}"
    rows = [json.loads(ln) for ln in res.stdout.splitlines() if ln.startswith("{")]
    assert rows, f"{script} printed no JSON line; stdout:\n{res.stdout[-2000:]}"
    return rows


THROUGHPUT_KEYS = {
    "label", "tokens_per_s_per_device", "step_time_s", "step_time_median_s", "step_time_min_s",
    "mfu_measured_pct", "peak_tflops_measured", "mfu_datasheet_pct", "peak_tflops_datasheet",
    "flops_per_token", "cpu_time_step_s", "tokens_per_cpu_s", "mfu_cpu_time_pct",
    "peak_tflops_cpu_time", "peak_memory_gib", "memory_kind", "loss_last", "steps", "warmup", "device",
    "device_name", "torch", "threads", "world_size", "load_avg", "load_avg_end", "config",
}  # fmt: skip


def _check_throughput(row: dict, label: str, steps: int) -> None:
    missing = THROUGHPUT_KEYS - row.keys()
    assert not missing, f"missing keys {missing} in {row}"
    assert row["label"] == label and row["steps"] == steps and row["world_size"] == 1
    tps, step_s = row["tokens_per_s_per_device"], row["step_time_s"]
    assert tps > 0 and step_s > 0
    # Tokens per step follow from the two figures (both rounded: 1% slack).
    assert math.isclose(tps * step_s, SEQ * BATCH, rel_tol=0.01), (tps, step_s)
    assert 0 < row["step_time_min_s"] <= row["step_time_median_s"]
    assert row["step_time_min_s"] <= step_s * 1.01
    mfu = row["mfu_measured_pct"]
    assert 0 < mfu <= 100, mfu
    expect = 100 * row["flops_per_token"] * tps / (row["peak_tflops_measured"] * 1e12)
    # mfu_measured_pct is rounded to 2 decimals (up to 0.005 off: 2% of an MFU of 0.21%), the
    # peak to 4 decimals of a TFLOP/s and tokens/s to 0.1: 1% relative plus the rounding step.
    assert math.isclose(mfu, expect, rel_tol=0.01, abs_tol=0.0051), (mfu, expect)
    # The CPU-time view: same tokens per step, its own peak, also a utilization in (0, 100].
    assert row["cpu_time_step_s"] > 0 and 0 < row["mfu_cpu_time_pct"] <= 100
    assert math.isclose(row["tokens_per_cpu_s"] * row["cpu_time_step_s"], SEQ * BATCH, rel_tol=0.01)
    # CPU: no datasheet peak is ever guessed.
    assert row["device"] == "cpu"
    assert row["mfu_datasheet_pct"] is None and row["peak_tflops_datasheet"] is None
    assert 0 < row["peak_memory_gib"] < 64 and row["memory_kind"] == "process RSS"
    assert math.isfinite(row["loss_last"]) and 0 < row["loss_last"] < 20
    assert row["torch"] == torch.__version__
    assert len(row["load_avg"]) == 3
    cfg = row["config"]
    assert cfg["seq_len"] == SEQ and cfg["local_batch_size"] == BATCH
    assert cfg["param_dtype"] == "float32" and cfg["model"] == "llama3 debugmodel"


def test_throughput_ladder_applies_the_variant(tmp_path: Path) -> None:
    """``--ladder --only`` runs the named variant in its own process (a plain run of the script,
    so this covers the single-run path too) with its flags applied."""
    (row,) = _run(
        "throughput.py",
        ["--ladder", "--only", "ac_op", "--warmup", "1", "--steps", "2", "--peak-budget", "0.3"]
        + ["--"]
        + _tiny(tmp_path),
    )
    _check_throughput(row, "ac_op", 2)
    cfg = row["config"]
    assert cfg["activation_checkpoint"] == "selective/op"
    assert cfg["compile"] is False and cfg["float8"] is None
    print("throughput:", {k: row[k] for k in ("tokens_per_s_per_device", "mfu_measured_pct")})


def test_throughput_ladder_rejects_unknown_label() -> None:
    res = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "throughput.py"), "--ladder", "--only", "nope"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode != 0 and "unknown labels ['nope']" in res.stderr


def test_overhead_script_json(tmp_path: Path) -> None:
    (row,) = _run(
        "overhead.py",
        ["--warmup", "1", "--steps", "1", "--rounds", "2", "--"] + _tiny(tmp_path),
    )
    keys = {
        "ratio", "ratio_best", "pair_ratios", "cpu_ratio", "cpu_pair_ratios", "trainer_step_s", "minimal_step_s",
        "trainer_cpu_step_s", "minimal_cpu_step_s", "trainer_rounds_s", "minimal_rounds_s",
        "steps_per_round", "log_freq", "device", "threads", "torch", "load_avg", "load_avg_end",
        "overrides",
    }  # fmt: skip
    assert not keys - row.keys(), f"missing keys {keys - row.keys()}"
    assert len(row["pair_ratios"]) == 2 and len(row["trainer_rounds_s"]) == 2
    assert row["trainer_step_s"] > 0 and row["minimal_step_s"] > 0
    # A tiny step on a shared machine is noisy, but the two loops do the same work: a ratio far
    # from 1 means one loop does something the other does not (or was not timed at all).
    for key in ("ratio", "ratio_best", "cpu_ratio"):
        assert 0.2 < row[key] < 5, (key, row[key])
    assert math.isclose(
        row["ratio_best"], min(row["minimal_rounds_s"]) / min(row["trainer_rounds_s"]), rel_tol=0.01
    )
    print("overhead:", {k: row[k] for k in ("ratio", "ratio_best", "cpu_ratio", "load_avg")})


def test_metrics_window_restarts_with_the_timer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokens and steps of an unlogged stretch before ``start_timer(step)`` (a resume, a second
    ``train()`` call as the benchmarks make) must not count in the next log's window."""
    clock = [100.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    m = MetricsProcessor(
        device=torch.device("cpu"),
        log_freq=5,
        total_steps=100,
        loss_mesh=None,
        flops_per_token=10,
        peak_flops=None,
        peak_flops_source="none",
        writers=[],
    )
    zero = torch.zeros(())
    for step in (1, 2, 3):  # not logged (as after a warm-up call that stopped at step 3)
        m.end_step(zero, zero, 1000, step=step)
    clock[0] = 200.0
    m.start_timer(3)
    for step in (4, 5):
        clock[0] += 2.0
        m.end_step(zero, zero, 1000, step=step)
    out = m.log(5, 1e-3)
    m.close()
    assert out["step_time_s"] == pytest.approx(2.0), out["step_time_s"]
    assert out["tokens_per_s"] == pytest.approx(500.0), out["tokens_per_s"]


def test_matmul_peak_in_cpu_time() -> None:
    """The CPU-time peak ``throughput.py`` reports on CPU: a real rate, and on one thread not
    below the wall-clock rate of the same matmuls but for the noise between two separate runs
    (one thread cannot get more CPU time than wall time; other work on the machine only lowers
    the wall-clock rate)."""
    from torchtitan.tools.peak_flops import measure_matmul_peak_flops

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cpu = measure_matmul_peak_flops("cpu", torch.float32, size=256, iters=5, cpu_time=True)
        wall = measure_matmul_peak_flops("cpu", torch.float32, size=256, iters=5)
    finally:
        torch.set_num_threads(threads)
    print(f"cpu-time peak {cpu / 1e9:.1f} GFLOP/s, wall {wall / 1e9:.1f} GFLOP/s")
    assert 1e8 < cpu < 1e14 and 1e8 < wall < 1e14
    # Separate runs of 5 matmuls each: allow 30% for the clock granularity and noise.
    assert cpu > 0.7 * wall, (cpu, wall)


@pytest.mark.slow
def test_dataloader_benchmark(tmp_path: Path) -> None:
    """benchmarks/dataloader.py on a small synthetic corpus: every documented row, tokenized
    loading faster than the text path at dp 8, and rank 1023 of 1024 starting in under a second."""
    args = ["--corpus-gib", "0.02", "--seq-len", "128", "--batches", "3", "--tmp", str(tmp_path)]
    rows = _run("dataloader.py", args)
    kinds = [r["bench"] for r in rows]
    assert kinds.count("throughput") == 4 and kinds.count("startup") == 12
    assert kinds.count("synthetic_corpus") == 1 and kinds.count("text_far_rank") == 1
    tput = {(r["loader"], r["dp"]): r["tokens_per_s_per_rank"] for r in rows if "loader" in r}
    assert tput[("tokenized", 8)] > tput[("text", 8)] > 0
    far = [r for r in rows if r["bench"] == "startup" and r["rank"] == 1023]
    assert len(far) == 6 and all(r["build_s"] + r["first_batch_s"] < 1.0 for r in far)
    assert list(tmp_path.iterdir()) == []  # the synthetic corpus is removed


def test_hf_io_benchmark(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/hf_io.py on the debug model at 2 ranks: each rank reads exactly its share
    of the synthetic checkpoint, both write their part of the export, and nothing is left."""
    from tests.script_loader import load

    bench = load("benchmarks/hf_io.py", "hf_io_bench")
    assert bench.main(["--flavor", "debugmodel", "--ranks", "2", "--dir", str(tmp_path)]) == 0
    head, run = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert head["flavor"] == "debugmodel" and head["disk_read_GBps"] > 0
    assert run["ranks"] == 2 and run["max_read_over_share"] == 1.0, run
    assert all(w > 0 for w in run["per_rank_written_GB"]), run
    assert list(tmp_path.iterdir()) == []


def test_moe_grouped_gemm_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/moe_grouped_gemm.py: both paths timed where grouped_mm runs, equal results."""
    from tests.script_loader import load

    bench = load("benchmarks/moe_grouped_gemm.py", "moe_grouped_gemm_bench")
    r = bench.main(["--device", "cpu", "--warmup", "1", "--steps", "2", "--rows", "96"])
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == r
    assert r["loop"]["ms"] > 0 and r["shape"]["rows"] == 96
    if r["grouped_mm_supported"]:
        assert r["grouped"]["ms"] > 0 and r["speedup"] > 0
        assert r["max_abs_diff_out"] <= 1e-6 and r["rel_diff_w1_grad"] <= 1e-6
