"""Chunked linear + cross-entropy trains exactly like the whole-logits loss (docs/memory.md):
one process (20 steps, losses and gradient norms to 1e-6), and under tensor parallel with loss
parallel (vocabulary-sharded chunks) and on a pipeline's last stage, against one process."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.parity_cases import STEPS, check_parity, reference_metrics
from tests.parity import train_metrics

CHUNK = ["--training.loss_chunk_size", "100"]  # 8 x 64 tokens: 6 chunks, the last one short


def _worst(ref: list[dict], got: list[dict], key: str) -> float:
    assert len(ref) == len(got) == STEPS
    return max(abs(r[key] - g[key]) / abs(r[key]) for r, g in zip(ref, got))


def test_chunked_matches_whole_logits_one_process(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    ref = reference_metrics(tmp_path_factory)
    got = train_metrics(["--training.local_batch_size", "8", *CHUNK], 1, tmp_path, STEPS)
    loss, norm = _worst(ref, got, "loss"), _worst(ref, got, "grad_norm")
    print(f"chunked vs whole, {STEPS} steps: loss {loss:.2e}, grad norm {norm:.2e}")
    assert loss <= 1e-6 and norm <= 1e-6, (loss, norm)


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        ["--parallelism.tensor_parallel_degree", "2"],
        ["--parallelism.tensor_parallel_degree", "2", "--parallelism.disable_loss_parallel"],
        ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "8"],
    ],
    ids=["tp2-loss-parallel", "tp2-gathered", "pp2"],
)
def test_chunked_under_tp_and_pp(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, overrides: list[str]
) -> None:
    ref = reference_metrics(tmp_path_factory)
    check_parity(ref, [*overrides, *CHUNK], 2, tmp_path, f"chunked loss {' '.join(overrides)}")
