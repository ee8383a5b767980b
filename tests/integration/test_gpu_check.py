"""scripts/gpu_check.sh --cpu: the GPU self-check's whole sequence, small, on CPU.

Environment, the gpu-marked tests (skipped here), one ladder rung, the three MoE families' debug
flavors, the published MoE shapes' benchmark rows through the preflight, the experts' grouped GEMM against their loop, 8 training steps with three
background checkpoints, a resume to step 10 and generation from the checkpoint; the summary
table lists each with PASS and the script exits 0.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.smoke
def test_gpu_check_cpu_mode(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check"
    env = {**os.environ, "TORCHTITAN_PYTHON": sys.executable, "OUT": str(out)}
    res = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--cpu"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    summary = (out / "summary.txt").read_text()
    print(summary)
    assert summary == res.stdout[-len(summary) :]
    rows = {
        line[:30].strip(): line[30:].split()
        for line in summary.splitlines()
        if line[30:37].strip() in ("PASS", "FAIL")
    }
    ladders = ["ladder eager", "ladder qwen3_moe", "ladder deepseek_v3", "ladder gpt_oss"]
    ladders += ["ladder qwen3_5", "ladder qwen3_5_moe"]
    expected = ["environment", "pytest -m gpu", *ladders, "moe shapes preflight"]
    expected += ["grouped GEMM vs loop"]
    expected += ["delta rule fla vs chunked", "train 8 steps", "resume to 10"]
    assert list(rows) == [*expected, "generate"], list(rows)
    assert all(cols[0] == "PASS" for cols in rows.values()), rows
    assert "3 background saves committed" in summary
    assert "resumed after step 8, last step 10" in summary
    assert "skipped" in summary and "8 token ids" in summary
    assert "18 of 18 rows valid" in summary  # 6 published MoE shapes x (eager, compile, float8)
    assert summary.strip().endswith(f"result: PASS (logs in {out})")
