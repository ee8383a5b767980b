"""Tier 3: tensor parallel (with sequence and loss parallel) and FSDP x TP match one process.

fp32, 20 steps, same global batch as the single-process reference; the worst step and
difference are printed for every case (``pytest -s`` shows them).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.parity_cases import check_parity, reference_metrics

TP = "--parallelism.tensor_parallel_degree"
LB = "--training.local_batch_size"

CASES = {
    # id: (world size, overrides)
    "tp2": (2, [TP, "2", LB, "8"]),
    # Accumulation (2 microbatches of 4) and the gathered-logits loss in one run.
    "tp2-accum2-no-loss-parallel": (2, [TP, "2", LB, "4", "--parallelism.disable_loss_parallel"]),
    "tp4": (4, [TP, "4", LB, "8"]),
    "fsdp2xtp2": (4, [TP, "2", "--parallelism.data_parallel_shard_degree", "2", LB, "4"]),
    # FSDP 2 x TP 2 with 2 accumulation steps (local batch 2) also matches (worst 1.2e-6), but
    # costs ~90 s of CI time; accumulation is covered by tp2-accum2 here and by FSDP/HSDP.
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return reference_metrics(tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_tp_matches_single_process(reference: list[dict], tmp_path: Path, case: str) -> None:
    world, overrides = CASES[case]
    check_parity(reference, overrides, world, tmp_path, label=case)
