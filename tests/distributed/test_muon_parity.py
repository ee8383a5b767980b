"""Tier 3: Muon under every layout trains like one process (fp32, 10 steps, loss within 1e-5),
resumes bitwise and reshards (docs/optimizers.md, "Distributed Muon").

Muon's update depends on each whole matrix (Newton-Schulz), so a layout that orthogonalised
its local shards instead would drift from the first step: these cases catch exactly that.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import torchtitan.training.trainer  # noqa: F401  (imported once in the parent, not in every rank)
from tests.checkpoint_helpers import assert_checkpoints_identical, ckpt_argv, train_with_faults
from tests.distributed.parity_cases import FamilyParity
from tests.launcher import run_ranks
from tests.parity import assert_losses_match, losses, train_metrics

STEPS = 10
MUON = ["--optimizer.name", "Muon", "--optimizer.muon_ns_dtype", "float32"]
MOE = ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe"]
# One-process references per model, cached per session; each loss must fall by 0.3.
PARITY = FamilyParity(MUON, STEPS)


_P = "--parallelism."
# layout -> (model, ranks, overrides); the local batch keeps the global batch at 8 sequences
LAYOUTS: dict[str, tuple[str, int, list[str]]] = {
    "FSDP 2": ("dense", 2, ["--training.local_batch_size", "4"]),
    "HSDP 2x2": ("dense", 4, [_P + "data_parallel_replicate_degree", "2", "--training.local_batch_size", "2"]),
    "TP 2": ("dense", 2, [_P + "tensor_parallel_degree", "2", "--training.local_batch_size", "8"]),
    "FSDP 2 x TP 2": ("dense", 4, [_P + "tensor_parallel_degree", "2", "--training.local_batch_size", "4"]),
    "PP 2": ("dense", 2, [_P + "pipeline_parallel_degree", "2", "--training.local_batch_size", "8"]),
    "EP 2 x FSDP 2": ("moe", 4, [*MOE, _P + "expert_parallel_degree", "2", "--training.local_batch_size", "2"]),
}  # fmt: skip


@pytest.mark.parametrize(
    "layout",
    [
        "FSDP 2",
        *(pytest.param(name, marks=pytest.mark.slow) for name in LAYOUTS if name != "FSDP 2"),
    ],
)
def test_muon_matches_single_process(
    layout: str, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    model, world, overrides = LAYOUTS[layout]
    ref = losses(PARITY.reference(tmp_path_factory, tuple(MOE) if model == "moe" else ()))
    got = losses(train_metrics([*MUON, *overrides], world, tmp_path, STEPS))
    assert_losses_match(ref, got, rtol=1e-5, label=f"Muon {layout}")


def _run(world: int, argv: list[str], dump: Path) -> list[dict]:
    results = run_ranks(train_with_faults, world, argv, str(dump), timeout=600)
    assert results[0] is not None, "rank 0 wrote no metrics"
    return results[0]


def _ckpt(dump: Path, step: int) -> Path:
    return dump / "checkpoint" / f"step-{step}"


RESUME = {
    "FSDP 2": (2, ["--training.local_batch_size", "4"]),
    "FSDP 4": (4, ["--training.local_batch_size", "2"]),
    "TP 2": (2, ["--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("loaded_by", ["FSDP 2", "FSDP 4", "TP 2"])
def test_muon_resume(loaded_by: str, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path):
    """6 straight FSDP 2 steps (checkpoints at 3 and 6) against 3 steps + resume under
    ``loaded_by``: bitwise under FSDP 2 (losses, grad norms, the step-6 checkpoint with Muon's
    momentum buffers), to 1e-5 when the momentum buffers are resharded to FSDP 4 or TP 2."""
    straight = tmp_path_factory.mktemp("muon_straight")
    world, overrides = RESUME["FSDP 2"]
    ref = _run(world, ckpt_argv(*MUON, *overrides), straight)
    shutil.copytree(_ckpt(straight, 3), _ckpt(tmp_path, 3))
    world, overrides = RESUME[loaded_by]
    resumed = _run(world, ckpt_argv(*MUON, *overrides), tmp_path)
    assert [m["step"] for m in resumed] == [4, 5, 6]
    if loaded_by == "FSDP 2":
        assert losses(resumed) == losses(ref)[3:], (losses(resumed), losses(ref)[3:])
        assert [m["grad_norm"] for m in resumed] == [m["grad_norm"] for m in ref[3:]]
        assert_checkpoints_identical(_ckpt(straight, 6), _ckpt(tmp_path, 6))
    else:
        label = f"Muon FSDP 2 -> {loaded_by}"
        assert_losses_match(losses(ref)[3:], losses(resumed), rtol=1e-5, label=label)
