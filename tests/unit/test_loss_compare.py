"""scripts/loss_compare.py on metrics files: the table, the verdict and the exit status.

The run mode (two real trainings) is tested in tests/integration/test_loss_compare_run.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.script_loader import load

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "loss_compare.py"
loss_compare = load("scripts/loss_compare.py", "loss_compare")


def write(path: Path, losses: dict[int, float]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "".join(
            json.dumps({"step": s, "loss": v, "grad_norm": 1.0}) + "\n" for s, v in losses.items()
        )
    )
    return path


def test_within_tolerance_prints_every_step(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    a = write(tmp_path / "a.jsonl", {1: 8.0, 2: 7.5, 3: 7.0})
    b = write(tmp_path / "b.jsonl", {1: 8.0, 2: 7.5 + 7.5e-6, 3: 7.0 - 3.5e-6})
    assert loss_compare.main([str(a), str(b)]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["1", "2", "3"]
    assert float(rows[1][1]) == 7.5 and abs(float(rows[1][2]) - 7.5000075) < 1e-7
    assert "worst: step 2" in out and "relative 1.000e-06" in out and out.rstrip().endswith("OK")


def test_over_tolerance_fails_naming_the_step(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    a = write(tmp_path / "a.jsonl", {1: 8.0, 2: 7.5, 3: 7.0})
    b = write(tmp_path / "b.jsonl", {1: 8.0, 2: 7.5, 3: 7.01})
    assert loss_compare.main([str(a), str(b), "--rtol", "1e-5"]) == 1
    out = capsys.readouterr().out
    assert "worst: step 3" in out and "FAIL (1 steps over)" in out
    assert [line for line in out.splitlines() if "over tolerance" in line][0].split()[0] == "3"
    # A looser tolerance, absolute or relative, accepts it.
    assert loss_compare.main([str(a), str(b), "--atol", "0.02"]) == 0
    assert loss_compare.main([str(a), str(b), "--rtol", "2e-3"]) == 0


def test_missing_steps_and_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    a = write(tmp_path / "a.jsonl", {1: 8.0, 2: 7.5, 3: 7.0})
    write(tmp_path / "run_b" / "metrics" / "rank_0.jsonl", {1: 8.0, 2: 7.5})
    # A dump folder is accepted in place of its metrics file; a step only in A fails.
    assert loss_compare.main([str(a), str(tmp_path / "run_b")]) == 1
    assert "steps only in run A: 3" in capsys.readouterr().out
    assert loss_compare.main([str(a), str(tmp_path / "nope.jsonl")]) == 2
    assert loss_compare.main([str(a)]) == 2
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    assert loss_compare.main([str(a), str(tmp_path / "bad.jsonl")]) == 2
    assert "bad.jsonl:1: not JSON" in capsys.readouterr().err
    # Another metric can be compared.
    assert loss_compare.main([str(a), str(a), "--metric", "grad_norm"]) == 0
