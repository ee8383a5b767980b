"""Checkpoints of an expert-parallel MoE run (docs/checkpoint.md, docs/moe.md): the experts are
DTensors on the (efsdp, ep) mesh, so DCP saves each expert once and can load it into any other
expert-parallel degree.

- EP 2 x FSDP 2 (4 ranks): 6 straight steps == 3 steps + resume + 3 steps, bit for bit (losses,
  grad norms and every entry of the step-6 checkpoint, the routing bias buffers included).
- The step-3 checkpoint of EP 2 x FSDP 2 resumed by EP 4 (4 ranks) and by EP 1 (FSDP 2 on
  2 ranks): steps 4..6 match the straight EP 2 x FSDP 2 run to 1e-5 (reduction orders differ).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.checkpoint_helpers import (
    STEPS,
    assert_checkpoints_identical,
    ckpt_argv,
    train_with_faults,
)
from tests.launcher import run_ranks
from tests.parity import assert_losses_match, losses

MOE = ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe"]
# Aux loss and aux-loss-free bias both on: the bias is state a resume must restore.
BALANCE = ["--model.moe_bias_update_rate", "0.001"]
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "EP 2 x FSDP 2": (
        4,
        ["--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "2"],
    ),
    "EP 4": (4, ["--parallelism.expert_parallel_degree", "4", "--training.local_batch_size", "2"]),
    "EP 1 (FSDP 2)": (2, ["--training.local_batch_size", "4"]),
    "HSDP 2 x EP 2": (
        4,
        [
            "--parallelism.expert_parallel_degree",
            "2",
            "--parallelism.data_parallel_replicate_degree",
            "2",
            "--training.local_batch_size",
            "2",
        ],
    ),
    "EP 2 x CP 2": (
        4,
        [
            "--parallelism.expert_parallel_degree",
            "2",
            "--parallelism.context_parallel_degree",
            "2",
            "--training.local_batch_size",
            "4",
        ],
    ),
}


def _run(layout: str, dump: Path) -> list[dict]:
    world, overrides = LAYOUTS[layout]
    argv = ckpt_argv(*MOE, *BALANCE, *overrides)
    results = run_ranks(train_with_faults, world, argv, str(dump), timeout=600)
    assert results[0] is not None, "rank 0 wrote no metrics"
    return results[0]


def _ckpt(dump: Path, step: int) -> Path:
    return dump / "checkpoint" / f"step-{step}"


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], Path]:
    dump = tmp_path_factory.mktemp("moe_straight")
    metrics = _run("EP 2 x FSDP 2", dump)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    return metrics, dump


def _resume(src: Path, layout: str, dump: Path) -> list[dict]:
    shutil.copytree(src, _ckpt(dump, 3))
    resumed = _run(layout, dump)
    assert [m["step"] for m in resumed] == [4, 5, 6]
    return resumed


@pytest.mark.slow
def test_ep2_fsdp2_bitwise_resume(straight: tuple[list[dict], Path], tmp_path: Path) -> None:
    ref, ref_dump = straight
    resumed = _resume(_ckpt(ref_dump, 3), "EP 2 x FSDP 2", tmp_path)
    assert losses(resumed) == losses(ref)[3:], (losses(resumed), losses(ref)[3:])
    assert [m["grad_norm"] for m in resumed] == [m["grad_norm"] for m in ref[3:]]
    n = assert_checkpoints_identical(_ckpt(ref_dump, 6), _ckpt(tmp_path, 6))
    print(f"EP 2 x FSDP 2: 3 steps + resume + 3 steps == 6 steps; {n} entries identical")


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["EP 4", "EP 1 (FSDP 2)", "HSDP 2 x EP 2", "EP 2 x CP 2"])
def test_resume_at_another_ep_degree(
    layout: str, straight: tuple[list[dict], Path], tmp_path: Path
) -> None:
    ref, ref_dump = straight
    resumed = _resume(_ckpt(ref_dump, 3), layout, tmp_path)
    assert_losses_match(
        losses(ref)[3:], losses(resumed), rtol=1e-5, label=f"EP 2 x FSDP 2 -> {layout}"
    )
