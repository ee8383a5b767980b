"""Bitwise resume under the memory levers (docs/memory.md): bf16 Adam moments, bf16 master
weights and FSDP CPU offload, each on 2 FSDP ranks (and offload on one process too). A run stopped after step 2 (checkpoint) and
resumed reproduces the uninterrupted 4-step run's losses, gradient norms and final checkpoint
(model, optimizer state in its low precision, RNG) bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.checkpoint_helpers import (
    assert_checkpoints_identical,
    ckpt_argv,
    fresh_metrics,
    read_checkpoint,
    train_with_faults,
)
from tests.launcher import run_ranks

LEVERS = {
    "bf16-moments": ["--optimizer.moments_dtype", "bfloat16"],
    "bf16-master-weights": [
        "--optimizer.master_weights_dtype",
        "bfloat16",
        "--training.mixed_precision_param",
        "auto",
    ],
    "cpu-offload": ["--parallelism.fsdp_cpu_offload"],
    # One process: FSDP on the 1-rank mesh, what offload on a single GPU runs.
    "cpu-offload-1dev": ["--parallelism.fsdp_cpu_offload"],
}


def _run(argv: list[str], dump: Path, stop_after: int | None = None, ranks: int = 2) -> list[dict]:
    # stop_after: SIGTERM after that step (the run checkpoints and exits 0).
    results = run_ranks(train_with_faults, ranks, argv, str(dump), stop_after, 0, timeout=600)
    assert results[0] is not None, "rank 0 wrote no metrics"
    return results[0]


@pytest.mark.slow
@pytest.mark.parametrize("lever", list(LEVERS))
def test_bitwise_resume(lever: str, tmp_path: Path) -> None:
    ranks = 1 if lever.endswith("1dev") else 2
    base = ["--training.local_batch_size", str(8 // ranks), *LEVERS[lever]]
    argv = ckpt_argv(*base, steps=4, interval=2)
    straight = _run(argv, tmp_path / "straight", ranks=ranks)
    first = _run(argv, tmp_path / "resumed", stop_after=2, ranks=ranks)
    fresh_metrics(tmp_path / "resumed")
    resumed = _run(argv, tmp_path / "resumed", ranks=ranks)
    assert [m["step"] for m in first + resumed] == list(range(1, 5))
    for key in ("loss", "grad_norm"):
        assert [m[key] for m in first + resumed] == [m[key] for m in straight], key
    final = [d / "checkpoint" / "step-4" for d in (tmp_path / "straight", tmp_path / "resumed")]
    n = assert_checkpoints_identical(*final)
    state = read_checkpoint(final[0])
    moments = [v for k, v in state.items() if "exp_avg" in k and hasattr(v, "dtype")]
    weights = [v for k, v in state.items() if k.startswith("model.") and hasattr(v, "dtype")]
    assert moments and weights
    want_m = "bfloat16" if lever == "bf16-moments" else "float32"
    want_w = "bfloat16" if lever == "bf16-master-weights" else "float32"
    assert {str(v.dtype) for v in moments} == {f"torch.{want_m}"}
    assert {str(v.dtype) for v in weights if v.is_floating_point()} == {f"torch.{want_w}"}
    print(f"{lever}: 2 + resume + 2 steps == 4 steps bitwise; {n} checkpoint entries identical")
