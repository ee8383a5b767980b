"""Tier 3: HSDP (replicate x shard) and DDP match one process, with and without accumulation.

fp32, 20 steps, same global batch as the single-process reference.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.parity_cases import check_parity, reference_metrics

REP = "--parallelism.data_parallel_replicate_degree"
SHARD = "--parallelism.data_parallel_shard_degree"
LB = "--training.local_batch_size"

CASES = {
    # id: (world size, overrides)
    "hsdp2x2": (4, [REP, "2", SHARD, "2", LB, "2"]),
    # 2 microbatches of 1 per rank; parameters stay gathered between forward and backward.
    "hsdp2x2-accum2-no-reshard": (
        4,
        [REP, "2", SHARD, "2", LB, "1", "--parallelism.fsdp_reshard_after_forward", "never"],
    ),
    "ddp2": (2, [REP, "2", SHARD, "1", LB, "4"]),
    "ddp2-accum2": (2, [REP, "2", SHARD, "1", LB, "2"]),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return reference_metrics(tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_data_parallel_matches_single_process(
    reference: list[dict], tmp_path: Path, case: str
) -> None:
    world, overrides = CASES[case]
    check_parity(reference, overrides, world, tmp_path, label=case)
