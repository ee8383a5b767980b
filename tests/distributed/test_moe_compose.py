"""Expert parallel composed with context parallel, HSDP and activation checkpointing, against
one process (fp32, same global batch, every step's loss within 1e-5 relative; docs/moe.md,
"Parallelisms"). The debug MoE: 8 experts, top-2, one shared expert, auxiliary loss 0.01.

* EP over CP: the ``ep`` ranks are borrowed from ``dp_shard x cp``; cp ranks hold parts of the
  same sequences, and the sequence-wise auxiliary loss sums the expert load over ``cp``.
* EP x HSDP: experts sharded over ``ep`` and replicated across ``dp_replicate``.
* AC (full, selective by block, op-level) under EP 2: the MoE layers' all-to-alls run again in
  the recomputation, and the expert-load statistics count each forward once.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.test_qwen3_parity import _compare, _ep

MOE = "debugmodel_moe"


CP2 = ("--parallelism.context_parallel_degree", "2")


def test_moe_ep2_over_cp2(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    """2 ranks: dp_shard 1 x cp 2, and ep 2 borrowed from the cp axis: the two ranks hold
    halves of the same 8 sequences and exchange their tokens' rows by all-to-all."""
    _compare(MOE, tmp_path_factory, tmp_path, 2, _ep(2, 8, *CP2), "Qwen3-MoE EP 2 over CP 2")


@pytest.mark.slow
def test_moe_ep2_cp2(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    """4 ranks: dp_shard 2 x cp 2 = efsdp 2 x ep 2 (ep the inner cp axis, experts FSDP-sharded
    over dp_shard)."""
    _compare(MOE, tmp_path_factory, tmp_path, 4, _ep(2, 4, *CP2), "Qwen3-MoE EP 2 x CP 2")


@pytest.mark.slow
def test_moe_cp2(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    """CP 2 without EP: the auxiliary loss still sees the whole sequence's expert load."""
    overrides = ["--training.local_batch_size", "8", *CP2]
    _compare(MOE, tmp_path_factory, tmp_path, 2, overrides, "Qwen3-MoE CP 2")


@pytest.mark.slow
def test_moe_hsdp2_ep2(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    """4 ranks: dp_replicate 2 x dp_shard 2, ep 2 = dp_shard: each replica holds 4 experts per
    rank, and the expert gradients are all-reduced across the replicas."""
    overrides = _ep(2, 2, "--parallelism.data_parallel_replicate_degree", "2")
    _compare(MOE, tmp_path_factory, tmp_path, 4, overrides, "Qwen3-MoE HSDP 2 x EP 2")


AC = {
    "full": ["--activation_checkpoint.mode", "full"],
    "selective_2": [
        "--activation_checkpoint.mode",
        "selective",
        "--activation_checkpoint.selective_ac_option",
        "2",
    ],
    "selective_op": [
        "--activation_checkpoint.mode",
        "selective",
        "--activation_checkpoint.selective_ac_option",
        "op",
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(AC))
def test_moe_ep2_ac(mode: str, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    overrides = _ep(2, 4, *AC[mode])
    _compare(MOE, tmp_path_factory, tmp_path, 2, overrides, f"Qwen3-MoE EP 2 + AC {mode}")
