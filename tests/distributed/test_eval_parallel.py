"""lm-eval at any layout (docs/evaluation.md): requests split over 2 data-parallel ranks give the
same per-request answers as 1 rank (bitwise: each rank runs whole batches of the 1-rank run,
eval/requests.py, with one thread per rank), and tensor parallel 2 within 1e-5 (its sharded
matmuls sum in another order), every rank holding the whole, ordered result."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lm_eval")

from tests.eval_helpers import (  # noqa: E402
    answers,
    eval_config,
    make_checkpoint,
    max_loglikelihood_diff,
)
from tests.launcher import run_ranks  # noqa: E402

LIMIT = 16


def _run(step: str, dump: str, tp: int) -> dict[str, Any]:
    from torchtitan.eval.__main__ import evaluate

    cfg = eval_config(Path(step), Path(dump), limit=LIMIT)
    cfg.parallelism.tensor_parallel_degree = tp
    return answers(evaluate(cfg, log_samples=True).last_results)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("eval_ckpt")
    step = make_checkpoint(root)
    (one,) = run_ranks(_run, 1, str(step), str(root / "one"), 1)
    return step, one


def _compare(one: dict[str, Any], many: list[dict[str, Any]], tol: float, label: str) -> None:
    for rank, got in enumerate(many):
        diff = max_loglikelihood_diff(one["torchtitan_facts_mc"], got["torchtitan_facts_mc"])
        print(f"{label} rank {rank}: max |loglikelihood diff| vs 1 rank {diff:.2e}")
        assert diff <= tol
        assert got["torchtitan_facts_gen"] == one["torchtitan_facts_gen"]
        assert len(got["torchtitan_facts_mc"]) == LIMIT


def test_two_data_parallel_ranks_match_one(checkpoint: Any, tmp_path: Path) -> None:
    step, one = checkpoint
    _compare(one, run_ranks(_run, 2, str(step), str(tmp_path), 1), 0.0, "dp2")


@pytest.mark.slow
def test_tensor_parallel_2_matches_one(checkpoint: Any, tmp_path: Path) -> None:
    step, one = checkpoint
    _compare(one, run_ranks(_run, 2, str(step), str(tmp_path), 2), 1e-5, "tp2")
