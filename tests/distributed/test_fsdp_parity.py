"""Tier 3: FSDP2 on 2 and 4 gloo ranks trains exactly like one process (fp32, same global batch)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.parity_cases import STEPS, reference_metrics
from tests.parity import assert_losses_match, losses, train_metrics


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    # The 20-step single-process run, shared with the TP/HSDP/DDP parity modules.
    return losses(reference_metrics(tmp_path_factory))


@pytest.mark.parametrize(
    "world, local_batch",
    # (2, 2): 2 ranks x 2 sequences x 2 accumulation steps; fsdp2 (and its 1-rank reference)
    # is in the smoke tier run against each end of the torch window.
    [pytest.param(2, 4, marks=pytest.mark.smoke), (4, 2), (2, 2)],
    ids=["fsdp2", "fsdp4", "fsdp2-accum2"],
)
def test_fsdp_matches_single_process(
    reference: list[float], tmp_path: Path, world: int, local_batch: int
) -> None:
    got = losses(
        train_metrics(["--training.local_batch_size", str(local_batch)], world, tmp_path, STEPS)
    )
    assert_losses_match(
        reference, got, rtol=1e-5, label=f"FSDP {world} (local batch {local_batch})"
    )
    assert reference[-1] < reference[0] - 0.5, (
        f"loss did not fall: {reference[0]:.3f} -> {reference[-1]:.3f}"
    )


def test_single_process_grad_accumulation_matches(reference: list[float], tmp_path: Path) -> None:
    got = losses(train_metrics(["--training.local_batch_size", "2"], 1, tmp_path, STEPS))
    assert_losses_match(reference, got, rtol=1e-5, label="1 rank x 4 accumulation steps")
