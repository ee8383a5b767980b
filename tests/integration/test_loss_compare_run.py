"""Tier 4: scripts/loss_compare.py in run mode: two real run_train.sh trainings compared."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "loss_compare.py"


@pytest.mark.slow
def test_run_mode_fsdp2_matches_one_process(tmp_path: Path) -> None:
    """Two real run_train.sh runs: 1 rank x local batch 8 vs 2 FSDP ranks x local batch 4."""
    common = (
        "--training.seq_len 64 --training.global_batch_size 8 "
        "--training.mixed_precision_param float32 --metrics.no-enable_tensorboard "
        "--lr_scheduler.warmup_steps 2"
    )
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--steps",
        "4",
        "--common",
        common,
        "--a",
        "--training.local_batch_size 8",
        "--b",
        "--training.local_batch_size 4",
        "--ngpu-b",
        "2",
        "--out",
        str(tmp_path),
    ]
    env = dict(os.environ, TORCHTITAN_PYTHON=sys.executable, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["1", "2", "3", "4"], proc.stdout
    assert float(rows[-1][1]) < float(rows[0][1])  # real losses, falling
    assert (tmp_path / "b" / "metrics" / "rank_0.jsonl").exists() and (tmp_path / "b.log").exists()
