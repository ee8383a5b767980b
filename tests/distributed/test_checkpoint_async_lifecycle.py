"""Background saves for a whole run: the stager lifecycle on every torch of the window.

One run of 8 steps on 2 gloo ranks checkpoints every 2 steps: steps 2, 4 and 6 are background
saves through the checkpoint manager's stager (step 8, the last, is synchronous). Then a run
resumes from the step-4 checkpoint (written by the second background save) and must reproduce
steps 5..8 and the final checkpoint bitwise. Without pinned memory on CPU (``async``); the
pinned path (``async_with_pinned_mem``) is the ``gpu`` test below, with the same checks.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.checkpoint_helpers import assert_checkpoints_identical, ckpt_argv
from tests.launcher import run_ranks
from tests.parity import DEBUG_TOML, losses, read_jsonl
from torchtitan.tools.torch_compat import DEFAULT_STAGER_SINGLE_USE

STEPS, INTERVAL = 8, 2
BACKGROUND = [2, 4, 6]


def _train_counting_stagers(argv: list[str], dump: str) -> dict[str, Any]:
    """Train on this rank; also report how many stagers the background saves went through."""
    from torchtitan.checkpoint.manager import _StagerLifecycle
    from torchtitan.train import main

    seen: list[Any] = []  # the stagers themselves: kept alive, their ids cannot be reused
    for_save = _StagerLifecycle.for_save

    def counting(self: _StagerLifecycle) -> Any:
        stager = for_save(self)
        seen.append(stager)
        return stager

    _StagerLifecycle.for_save = counting  # type: ignore[method-assign]
    rc = main(["--job.config_file", DEBUG_TOML, "--job.dump_folder", dump, *argv])
    assert rc == 0, f"train exited {rc}"
    path = Path(dump) / "metrics" / f"rank_{os.environ['RANK']}.jsonl"
    metrics = read_jsonl(path) if path.exists() else None  # only logging ranks write metrics
    return {"metrics": metrics, "saves": len(seen), "stagers": len({id(s) for s in seen})}


def _argv(mode: str) -> list[str]:
    extra = ["--training.local_batch_size", "4", "--checkpoint.async_mode", mode]
    return ckpt_argv(*extra, steps=STEPS, interval=INTERVAL)


def _run(mode: str, dump: Path) -> dict[str, Any]:
    results = run_ranks(_train_counting_stagers, 2, _argv(mode), str(dump), timeout=600)
    return results[0]


def _check_lifecycle(mode: str, tmp_path: Path) -> None:
    full = _run(mode, tmp_path / "full")
    assert [m["step"] for m in full["metrics"]] == list(range(1, STEPS + 1))
    root = tmp_path / "full" / "checkpoint"
    assert sorted(int(p.name.split("-")[1]) for p in root.glob("step-*")) == [*BACKGROUND, STEPS]
    assert full["saves"] == len(BACKGROUND), full["saves"]
    # One stager for the whole run where torch allows reuse, a fresh one per save otherwise.
    assert full["stagers"] == (len(BACKGROUND) if DEFAULT_STAGER_SINGLE_USE else 1)

    # Resume from the second background save in a fresh folder: steps 5..8 again.
    resumed_root = tmp_path / "resumed" / "checkpoint"
    resumed_root.mkdir(parents=True)
    shutil.copytree(root / "step-4", resumed_root / "step-4")
    resumed = _run(mode, tmp_path / "resumed")
    assert [m["step"] for m in resumed["metrics"]] == [5, 6, 7, 8]
    assert losses(resumed["metrics"]) == losses(full["metrics"])[4:]
    grad_norms = [m["grad_norm"] for m in resumed["metrics"]]
    assert grad_norms == [m["grad_norm"] for m in full["metrics"][4:]]
    n = assert_checkpoints_identical(root / f"step-{STEPS}", resumed_root / f"step-{STEPS}")
    assert n > 10, f"only {n} entries compared"


@pytest.mark.smoke
def test_three_background_saves_then_bitwise_resume(tmp_path: Path) -> None:
    _check_lifecycle("async", tmp_path)


@pytest.mark.gpu
def test_pinned_background_saves_then_bitwise_resume(tmp_path: Path) -> None:
    """The pinned-memory stager on CUDA. The ranks here still run on CPU (the launcher pins
    them there), so this runs the trainer in one CUDA process per run instead."""
    _check_lifecycle_cuda(tmp_path)


def _check_lifecycle_cuda(tmp_path: Path) -> None:
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TORCHTITAN_DEVICE": "cuda", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    dumps = {"full": tmp_path / "full", "resumed": tmp_path / "resumed"}
    argv = [
        *_argv("async_with_pinned_mem"),
        "--training.local_batch_size",
        "8",
        "--debug.deterministic",
    ]
    for name, dump in dumps.items():
        if name == "resumed":
            (dump / "checkpoint").mkdir(parents=True)
            shutil.copytree(dumps["full"] / "checkpoint" / "step-4", dump / "checkpoint" / "step-4")
        cmd = [sys.executable, "-m", "torchtitan.train", "--job.config_file", DEBUG_TOML]
        res = subprocess.run(
            [*cmd, "--job.dump_folder", str(dump), *argv],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert res.returncode == 0, res.stderr[-3000:]
        assert "background save of step 6 committed" in res.stderr + res.stdout
    full = read_jsonl(dumps["full"] / "metrics" / "rank_0.jsonl")
    resumed = read_jsonl(dumps["resumed"] / "metrics" / "rank_0.jsonl")
    assert [m["step"] for m in resumed] == [5, 6, 7, 8]
    assert losses(resumed) == losses(full)[4:]
    last = f"checkpoint/step-{STEPS}"
    assert_checkpoints_identical(dumps["full"] / last, dumps["resumed"] / last)
