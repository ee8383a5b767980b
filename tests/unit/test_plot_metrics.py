"""scripts/plot_metrics.py: JSONL and TensorBoard runs -> PNG charts, several runs per chart."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.script_loader import load
from torchtitan.metrics.writers import JsonlWriter, TensorBoardWriter

ROOT = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"

pytest.importorskip("matplotlib")


def _script() -> ModuleType:
    return load("scripts/plot_metrics.py", "plot_metrics")


def _write_run(writer: JsonlWriter | TensorBoardWriter, scale: float, mfu: bool) -> None:
    for step in range(1, 11):
        writer.log(
            {
                "loss": scale * (8.0 - 0.3 * step),
                "grad_norm": 1.0 + 0.01 * step,
                "lr": 1e-3 * step / 10,
                "tokens_per_s": 1000.0 + step,
                "mfu": 30.0 + step if mfu else None,
                "memory/peak_gib": 1.5,
                "memory/current_gib": 1.2,
            },
            step,
        )
        if step % 5 == 0:
            writer.log({"validation/loss": scale * (7.0 - 0.2 * step)}, step)
    writer.close()


def test_jsonl_and_tensorboard_runs_share_charts(tmp_path: Path) -> None:
    pm = _script()
    a, b = tmp_path / "run_a", tmp_path / "run_b"
    _write_run(JsonlWriter(a / "metrics" / "rank_0.jsonl"), 1.0, mfu=False)
    _write_run(TensorBoardWriter(b / "tb" / "rank_0"), 0.5, mfu=True)

    runs = {"a": pm.load_run(a), "b": pm.load_run(b)}  # JSONL dump folder; TB-only dump folder
    assert runs["a"]["validation/loss"] == [(5, 6.0), (10, 5.0)]
    assert "mfu" not in runs["a"]  # null in every line: nothing to plot
    assert runs["b"]["loss"][0][0] == 1 and runs["b"]["loss"][0][1] == pytest.approx(3.85)

    fig, charts = pm.build_figure(runs)
    assert list(charts) == ["loss", "lr", "grad_norm", "tokens_per_s", "mfu", "memory"]
    loss_lines = {ln.get_label(): ln for ln in charts["loss"].get_lines()}
    assert set(loss_lines) == {"a", "a (validation)", "b", "b (validation)"}
    steps, values = loss_lines["a"].get_data()
    assert list(steps) == list(range(1, 11)) and values[-1] == pytest.approx(5.0)
    assert list(loss_lines["b (validation)"].get_data()[1]) == pytest.approx([3.0, 2.5])
    assert [ln.get_label() for ln in charts["mfu"].get_lines()] == ["b"]  # only b knows MFU
    assert len(charts["memory"].get_lines()) == 4  # peak and current for each run

    # A per-step memory trace (<dump>/memory/rank_0.jsonl) replaces the log-step memory points.
    trace = [{"step": s, "warmup": s <= 3, "current_gib": 1.0 + 0.01 * s} for s in range(1, 11)]
    (a / "memory").mkdir()
    (a / "memory" / "rank_0.jsonl").write_text("".join(json.dumps(t) + "\n" for t in trace))
    traced = {"a": pm.load_run(a)}
    assert traced["a"]["memory_trace/warmup"][:4] == [(1, 1.0), (2, 1.0), (3, 1.0), (4, 0.0)]
    _, charts = pm.build_figure(traced)
    (current,) = [ln for ln in charts["memory"].get_lines() if ln.get_label() == "a current"]
    assert list(current.get_data()[0]) == list(range(1, 11))
    assert list(current.get_data()[1]) == pytest.approx([1.0 + 0.01 * s for s in range(1, 11)])
    assert any("warm-up" in t.get_text() for t in charts["memory"].texts)

    out = tmp_path / "plots"
    written = pm.plot_runs(runs, out)
    names = sorted(p.name for p in written)
    assert names == sorted(
        ["metrics.png", "loss.png", "lr.png", "grad_norm.png", "tokens_per_s.png"]
        + ["mfu.png", "memory.png"]
    )
    for p in written:
        assert p.read_bytes()[:8] == PNG and p.stat().st_size > 5000


def test_cli_on_a_jsonl_file_and_resumed_steps(tmp_path: Path) -> None:
    path = tmp_path / "rank_0.jsonl"
    rows = [
        {"step": 1, "loss": 9.0, "lr": 0.1},
        {"step": 2, "loss": 8.0, "lr": 0.2},
        {"step": 2, "loss": 7.5, "lr": 0.2},  # a resumed run logs step 2 again: last one wins
        {"step": 3, "loss": None, "lr": 0.3},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert _script().load_jsonl(path)["loss"] == [(1, 9.0), (2, 7.5)]
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts/plot_metrics.py"), str(path), "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert (out / "metrics.png").read_bytes()[:8] == PNG
    assert str(out / "loss.png") in proc.stdout
    bad = subprocess.run(
        [sys.executable, str(ROOT / "scripts/plot_metrics.py"), str(tmp_path / "nothing")],
        capture_output=True,
        text=True,
    )
    assert bad.returncode != 0 and "no metrics" in bad.stderr
