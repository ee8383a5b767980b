"""Tier 4: run_train.sh -> torchrun -> 2 CPU ranks of the debug model; the loss falls clearly."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tests.launcher import run_train_sh

LINE = re.compile(
    r"step\s+(\d+)\s+loss\s+([0-9.]+) \(avg\s+([0-9.]+)\).*tok/s\s+([0-9,]+)\s+mfu\s+([0-9.]+)%"
)


def test_run_train_debug_model_learns(tmp_path: Path) -> None:
    out = run_train_sh(
        tmp_path, "--training.steps", "30", "--training.seq_len", "128", "--metrics.log_freq", "5"
    )

    steps = [(int(m[1]), float(m[2])) for m in LINE.finditer(out)]
    assert [s for s, _ in steps] == [1, 5, 10, 15, 20, 25, 30], out[-4000:]
    first, last = steps[0][1], steps[-1][1]
    assert last < first - 2.0, f"loss did not fall clearly: {steps}"
    assert "[rank 0 dp_shard=0]" in out  # the rank's mesh coordinates prefix every line
    assert "mem rss" in out and "eta" in out

    records = [
        json.loads(x) for x in (tmp_path / "metrics" / "rank_0.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in records] == [1, 5, 10, 15, 20, 25, 30]
    for key in ("loss", "loss_avg", "grad_norm", "lr", "tokens_per_s", "mfu", "memory/rss_gib"):
        assert key in records[-1], key
    assert records[-1]["loss"] == steps[-1][1] or abs(records[-1]["loss"] - steps[-1][1]) < 1e-4
    assert list((tmp_path / "tb").rglob("events.out.tfevents.*")), "no TensorBoard event file"
