"""Run the real trainer in-process on N forked ranks and compare per-step losses."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.launcher import run_ranks

ROOT = Path(__file__).resolve().parents[1]
DEBUG_TOML = str(ROOT / "train_configs" / "debug_model.toml")

# Small enough for CPU: 8 sequences of 64 tokens per step, fp32, warm-up then decay.
TINY = [
    "--training.seq_len",
    "64",
    "--training.global_batch_size",
    "8",
    "--training.mixed_precision_param",
    "float32",
    "--lr_scheduler.warmup_steps",
    "3",
    "--metrics.log_freq",
    "1",
    "--metrics.no-enable_tensorboard",
    # A hung collective fails the test in a minute instead of hanging CI.
    "--comm.init_timeout_seconds",
    "90",
    "--comm.train_timeout_seconds",
    "90",
]

SMALL_FP32 = ["--training.seq_len", "64", "--training.local_batch_size", "2"]
SMALL_FP32 += ["--training.mixed_precision_param", "float32", "--metrics.log_freq", "1"]
"""Rows of 64 tokens, 2 per rank, fp32, every step logged (the small end-to-end runs)."""

PP2_1F1B = ["--parallelism.pipeline_parallel_degree", "2"]
PP2_1F1B += ["--parallelism.pipeline_parallel_schedule", "1F1B"]
"""Two pipeline stages, the 1F1B schedule (the families' PP parity runs, run_train.sh's PP test)."""

FSDP2_TP2 = ["--parallelism.data_parallel_shard_degree", "2"]
FSDP2_TP2 += ["--parallelism.tensor_parallel_degree", "2"]
"""FSDP 2 x TP 2 (the seed's 3D layout without its PP; the two-node run's layout)."""


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _train(argv: list[str], dump: str) -> list[dict] | None:
    from torchtitan.train import main

    rc = main(["--job.config_file", DEBUG_TOML, "--job.dump_folder", dump, *argv])
    assert rc == 0, f"train exited {rc}"
    path = Path(dump) / "metrics" / f"rank_{os.environ['RANK']}.jsonl"
    return read_jsonl(path) if path.exists() else None


def train_metrics(overrides: list[str], world_size: int, dump: Path, steps: int = 20) -> list[dict]:
    """Per-step metrics of rank 0 (log_freq 1) for a run of ``steps`` steps on ``world_size`` ranks."""
    argv = [*TINY, "--training.steps", str(steps), *overrides]
    results = run_ranks(_train, world_size, argv, str(dump))
    assert results[0] is not None, "rank 0 wrote no metrics"
    return results[0]


def losses(metrics: list[dict]) -> list[float]:
    return [m["loss"] for m in metrics]


def assert_losses_match(
    ref: list[float], got: list[float], rtol: float = 1e-5, label: str = ""
) -> float:
    """Max relative difference over steps; fails naming the worst step."""
    assert len(ref) == len(got), f"{label}: {len(ref)} reference steps vs {len(got)}"
    worst_step, worst = 0, 0.0
    for i, (a, b) in enumerate(zip(ref, got), start=1):
        rel = abs(a - b) / max(abs(a), 1e-12)
        if rel > worst:
            worst_step, worst = i, rel
    msg = (
        f"{label}: worst relative loss difference {worst:.3e} at step {worst_step} "
        f"(reference {ref[worst_step - 1]:.7f}, got {got[worst_step - 1]:.7f}); tolerance {rtol:.0e}"
    )
    print(msg)
    assert worst <= rtol, msg
    return worst


def assert_losses_close_but_changed(
    ref: list[float],
    got: list[float],
    rtol: float,
    label: str,
    above: float = 0.0,
    why: str = "compiled losses equal eager bitwise: was anything compiled?",
) -> float:
    """assert_losses_match, and the worst difference exceeds ``above`` (else the feature did nothing)."""
    worst = assert_losses_match(ref, got, rtol=rtol, label=label)
    assert worst > above, why
    return worst


def assert_validation_match(ref: list[dict], got: list[dict], label: str) -> list[list[dict]]:
    """Two runs' validation rows: the same token counts, losses within 1e-5; returns the rows."""
    rows = [[r for r in m if "validation/loss" in r] for m in (ref, got)]
    assert [r["validation/tokens"] for r in rows[1]] == [r["validation/tokens"] for r in rows[0]]
    assert_losses_match(
        [r["validation/loss"] for r in rows[0]],
        [r["validation/loss"] for r in rows[1]],
        rtol=1e-5,
        label=label,
    )
    return rows
