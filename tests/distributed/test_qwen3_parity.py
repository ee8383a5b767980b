"""Qwen3 under the parallelisms its plan allows, against one process (fp32, same global batch,
every step's loss within 1e-5 relative; docs/architecture.md, promise 1).

The MoE flavor (8 experts, top-2, one shared expert, auxiliary loss 0.01) under FSDP 2 checks
that the sequence-wise auxiliary loss and the per-rank routing train exactly like one process;
under PP 2 that the auxiliary loss, seeded in each stage's backward, does too.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import torchtitan.training.trainer  # noqa: F401  (imported once in the parent, not in every rank)
from tests.distributed.parity_cases import PP2_1F1B, FamilyParity

STEPS = 10
PARITY = FamilyParity(["--model.name", "qwen3"], STEPS)


def _compare(
    flavor: str,
    tmp_path_factory: pytest.TempPathFactory,
    tmp_path: Path,
    world: int,
    overrides: list[str],
    label: str,
) -> None:
    extra = ("--model.flavor", flavor)
    PARITY.compare(tmp_path_factory, tmp_path, world, overrides, label, extra)


PP2 = [*PP2_1F1B, "--training.local_batch_size", "8"]
EP2 = ["--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "4"]
TP2 = ["--parallelism.tensor_parallel_degree", "2"]


def _ep(ep: int, local_batch: int, *extra: str) -> list[str]:
    return [
        "--parallelism.expert_parallel_degree",
        str(ep),
        "--training.local_batch_size",
        str(local_batch),
        *extra,
    ]


# label -> (flavor, ranks, overrides). Under PP 2 the auxiliary loss is seeded in each stage's
# backward; with EP 2 x FSDP 2 (dp_shard 4 = efsdp 2 x ep 2) the experts are FSDP-sharded over
# efsdp; under TP the MoE blocks run whole on both ranks (ReplicateParallel), attention split.
SLOW_CASES = {
    "Qwen3-MoE FSDP 2": ("debugmodel_moe", 2, ["--training.local_batch_size", "4"]),
    "Qwen3-MoE PP 2": ("debugmodel_moe", 2, PP2),
    "Qwen3 FSDP 2 x TP 2": ("debugmodel", 4, [*TP2, "--training.local_batch_size", "4"]),
    "Qwen3 PP 2": ("debugmodel", 2, PP2),
    "Qwen3-MoE EP 2 x FSDP 2": ("debugmodel_moe", 4, _ep(2, 2)),
    "Qwen3-MoE EP 4": ("debugmodel_moe", 4, _ep(4, 2)),
    "Qwen3-MoE PP 2 x EP 2": ("debugmodel_moe", 4, _ep(2, 4, *PP2_1F1B)),
    "Qwen3-MoE TP 2": ("debugmodel_moe", 2, [*TP2, "--training.local_batch_size", "8"]),
    "Qwen3-MoE EP 2 x TP 2": ("debugmodel_moe", 4, _ep(2, 4, *TP2)),
}


@pytest.mark.slow
@pytest.mark.parametrize("label", list(SLOW_CASES))
def test_parallelism(label: str, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    flavor, world, overrides = SLOW_CASES[label]
    _compare(flavor, tmp_path_factory, tmp_path, world, overrides, label)


def test_moe_ep2(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    """EP 2 (borrowing the 2 data-parallel ranks, FSDP for the rest): 4 experts per rank,
    tokens dispatched and combined by all-to-all with uneven splits."""
    _compare("debugmodel_moe", tmp_path_factory, tmp_path, 2, EP2, "Qwen3-MoE EP 2")
