"""Qwen3.5 with vision under tensor parallel, FSDP x TP, HSDP and DDP (docs/vlm.md,
"Parallelism"): each layout trains 10 steps on image batches through the trainer and equals one
process (losses and gradient norms within 1e-5 relative, the final weights within 1e-5);
activation checkpointing and compile wrap the tower's blocks too.

The data (``scripts/make_vlm_data.py``, 8 samples) has an image in the even samples only, so a
one-sample batch (TP 2 with local batch 1) has no image every second step and, with two
data-parallel ranks, rank 1 never encodes one (its tower runs on zero patches every step).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.checkpoint_helpers import read_checkpoint
from tests.integration.test_vlm_run import FP32, VLM, _train
from tests.launcher import run_ranks
from tests.parity import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import make_vlm_data  # noqa: E402

STEPS = 10
EXPORT = ["--checkpoint.enable", "--checkpoint.interval", str(STEPS)]
EXPORT += ["--checkpoint.last_save_model_only"]  # the final weights, model only
LR = ["--optimizer.lr", "3e-4"]

Run = tuple[list[float], list[float], dict[str, torch.Tensor]]
"""Per-step losses, per-step gradient norms, the final weights."""


def _run(data: Path, dump: Path, ranks: int, argv: list[str]) -> Run:
    base = [*VLM, "--training.dataset_path", str(data), *FP32, *EXPORT, *LR]
    base += ["--training.steps", str(STEPS)]
    metrics = run_ranks(_train, ranks, [*base, *argv], str(dump), timeout=900.0)[0]
    weights = read_checkpoint(dump / "checkpoint" / f"step-{STEPS}")
    tensors = {k: v for k, v in weights.items() if isinstance(v, torch.Tensor)}
    return [m["loss"] for m in metrics], [m["grad_norm"] for m in metrics], tensors


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("vlm_data")
    make_vlm_data.write(folder, 8, 4, False, 400, text_only_every=2)
    return folder / "vlm.parquet"


@pytest.fixture(scope="module")
def one_process(data: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, int], Run]:
    """The one-process run of a flavor at a local batch size (each made once per module)."""
    runs: dict[tuple[str, int], Run] = {}

    def get(flavor: str, batch: int) -> Run:
        if (flavor, batch) not in runs:
            dump = tmp_path_factory.mktemp(f"one_{flavor}_{batch}")
            argv = ["--model.flavor", flavor, "--training.local_batch_size", str(batch)]
            runs[flavor, batch] = _run(data, dump, 1, argv)
        return runs[flavor, batch]

    return get


def _worst(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(x) for x, y in zip(a, b, strict=True))


def _assert_equal_runs(ref: Run, got: Run, label: str) -> None:
    """Losses within 1e-5 relative, every final weight within 1e-5 (relative and absolute);
    gradient norms within 1e-4 relative (the decoder's own TP 2, text only, differs from one
    process by up to 6e-5 in the norm the trainer reports: docs/vlm.md, "Parallelism")."""
    (loss_a, norm_a, w_a), (loss_b, norm_b, w_b) = ref, got
    assert len(loss_a) == len(loss_b) == STEPS
    assert set(w_a) == set(w_b) and any(k.startswith("model.visual.") for k in w_a)
    worst_w = max(w_a, key=lambda k: float((w_a[k] - w_b[k]).abs().max()))
    print(
        f"{label}: one process {loss_a}\n{label}: parallel {loss_b}\n{label}: worst relative "
        f"loss difference {_worst(loss_a, loss_b):.2e}, grad norm {_worst(norm_a, norm_b):.2e}; "
        f"worst weight {worst_w} {float((w_a[worst_w] - w_b[worst_w]).abs().max()):.2e}"
    )
    assert _worst(loss_a, loss_b) <= 1e-5, (loss_a, loss_b)
    assert _worst(norm_a, norm_b) <= 1e-4, (norm_a, norm_b)
    for k in w_a:
        torch.testing.assert_close(w_b[k], w_a[k], rtol=1e-5, atol=1e-5, msg=k)
    assert loss_a[-1] < loss_a[0]


def test_tp2_equals_one_process_on_image_batches(
    data: Path, tmp_path: Path, one_process: Callable[[str, int], Run]
) -> None:
    """TP 2 (sequence and loss parallel; the tower whole on both TP ranks), one sample a step:
    every second step has no image, so both ranks run the tower on zero patches."""
    argv = ["--training.local_batch_size", "1", "--parallelism.tensor_parallel_degree", "2"]
    got = _run(data, tmp_path, 2, argv)
    _assert_equal_runs(one_process("debugmodel", 1), got, "TP 2")


@pytest.mark.slow
def test_tp2_moe_equals_one_process_on_image_batches(
    data: Path, tmp_path: Path, one_process: Callable[[str, int], Run]
) -> None:
    argv = ["--model.flavor", "debugmodel_moe", "--training.local_batch_size", "1"]
    argv += ["--parallelism.tensor_parallel_degree", "2"]
    got = _run(data, tmp_path, 2, argv)
    _assert_equal_runs(one_process("debugmodel_moe", 1), got, "TP 2 MoE")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("degrees", "label"),
    [
        ({"data_parallel_shard_degree": 2, "tensor_parallel_degree": 2}, "FSDP 2 x TP 2"),
        ({"data_parallel_replicate_degree": 2, "data_parallel_shard_degree": 2}, "HSDP 2 x 2"),
        ({"data_parallel_replicate_degree": 2, "data_parallel_shard_degree": 1}, "DDP 2"),
    ],
    ids=["fsdp2_tp2", "hsdp2x2", "ddp2"],
)
def test_data_parallel_layouts_equal_one_process_on_image_batches(
    degrees: dict[str, int],
    label: str,
    data: Path,
    tmp_path: Path,
    one_process: Callable[[str, int], Run],
) -> None:
    """One sample per data-parallel rank a step: data-parallel rank 1 (and 3) never has an
    image, rank 0 (and 2) always has one."""
    dp = degrees.get("data_parallel_replicate_degree", 1) * degrees["data_parallel_shard_degree"]
    ranks = dp * degrees.get("tensor_parallel_degree", 1)
    argv = ["--training.local_batch_size", "1"]
    for name, degree in degrees.items():
        argv += [f"--parallelism.{name}", str(degree)]
    got = _run(data, tmp_path, ranks, argv)
    _assert_equal_runs(one_process("debugmodel", dp), got, label)
