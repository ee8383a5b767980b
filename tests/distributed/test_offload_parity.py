"""FSDP2 CPU offload (docs/memory.md) trains like FSDP without it: 2 gloo ranks, 20 steps, fp32,
per-step losses to 1e-5 and gradient norms to the parity tolerance, against the same 2-rank FSDP
run without offload; and on one process (FSDP on the 1-rank mesh, what a single GPU uses) and
with TP 2 / PP 2 at data_parallel_shard_degree 1, each against the same layout without offload.

On this CPU-only machine the device is the CPU, so FSDP2's host-device copies are CPU-to-CPU:
the test exercises the offload code path (CPUOffloadPolicy sharded parameters, gradient
offload, optimizer step on the offloaded shards), not the transfer cost."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.parity_cases import STEPS, assert_grad_norms_match
from tests.parity import assert_losses_match, losses, train_metrics

FSDP2 = ["--training.local_batch_size", "4"]


@pytest.mark.slow
def test_offload_matches_fsdp(tmp_path: Path) -> None:
    ref = train_metrics(FSDP2, 2, tmp_path / "fsdp", STEPS)
    got = train_metrics([*FSDP2, "--parallelism.fsdp_cpu_offload"], 2, tmp_path / "offload", STEPS)
    assert_losses_match(losses(ref), losses(got), rtol=1e-5, label="FSDP 2 + CPU offload")
    assert_grad_norms_match(ref, got, "FSDP 2 + CPU offload")


def test_offload_on_one_device_matches_no_offload(tmp_path: Path) -> None:
    """One process: FSDP2 on the 1-rank dp_shard mesh with CPUOffloadPolicy (what a single GPU
    uses to offload) against the plain single-process run, 10 steps."""
    one = ["--training.local_batch_size", "8"]
    ref = train_metrics(one, 1, tmp_path / "plain", 10)
    got = train_metrics([*one, "--parallelism.fsdp_cpu_offload"], 1, tmp_path / "offload", 10)
    assert_losses_match(losses(ref), losses(got), rtol=1e-5, label="1 device + CPU offload")
    assert_grad_norms_match(ref, got, "1 device + CPU offload")


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        ["--parallelism.tensor_parallel_degree", "2"],
        ["--parallelism.pipeline_parallel_degree", "2"],
    ],
    ids=["tp2", "pp2"],
)
def test_offload_with_dp_shard_1_composes(layout: list[str], tmp_path: Path) -> None:
    """TP 2 or PP 2 on 2 ranks, data_parallel_shard_degree 1: FSDP on the 1-rank mesh under
    offload, against the same layout without it (4 steps)."""
    one = ["--training.local_batch_size", "8", *layout]
    ref = train_metrics(one, 2, tmp_path / "plain", 4)
    got = train_metrics([*one, "--parallelism.fsdp_cpu_offload"], 2, tmp_path / "offload", 4)
    assert_losses_match(losses(ref), losses(got), rtol=1e-5, label=f"{layout} + CPU offload")
