"""A model family the library has never seen trains through the same generic code as Llama 3.

``tests/toy_model.py`` (the worked example of docs/extending.md) registers a GPT-style model
with other module names, norms and MLP, and its own parallel plan. Under FSDP 2, TP 2 (with
sequence and loss parallel) and PP 2 it must match one process step for step, which it can
only do if ``distributed/`` applies the plan it is given and assumes nothing about Llama.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import tests.toy_model  # noqa: F401  (registers "toy" before the ranks fork)
from tests.distributed.parity_cases import LOSS_RTOL, assert_grad_norms_match
from tests.parity import assert_losses_match, losses, train_metrics

STEPS = 12
TOY = ["--model.name", "toy", "--model.flavor", "tiny", "--optimizer.lr", "3e-3"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    got = train_metrics(
        [*TOY, "--training.local_batch_size", "8"], 1, tmp_path_factory.mktemp("toy"), STEPS
    )
    first, last = got[0]["loss"], got[-1]["loss"]
    assert last < first - 0.5, f"the toy model did not learn: {first:.3f} -> {last:.3f}"
    return got


@pytest.mark.parametrize(
    "overrides",
    [
        ["--training.local_batch_size", "4"],
        [
            "--training.local_batch_size", "8",
            "--parallelism.data_parallel_shard_degree", "1",
            "--parallelism.tensor_parallel_degree", "2",
        ],
        [
            "--training.local_batch_size", "8",
            "--parallelism.data_parallel_shard_degree", "1",
            "--parallelism.pipeline_parallel_degree", "2",
            "--parallelism.pipeline_parallel_split_points", "blocks.2",
        ],
    ],
    ids=["fsdp2", "tp2", "pp2"],
)  # fmt: skip
def test_toy_model_matches_single_process(
    reference: list[dict], tmp_path: Path, overrides: list[str]
) -> None:
    got = train_metrics([*TOY, *overrides], 2, tmp_path, STEPS)
    label = f"toy {' '.join(overrides[2:]) or 'fsdp 2'}"
    assert_losses_match(losses(reference), losses(got), rtol=LOSS_RTOL, label=label)
    assert_grad_norms_match(reference, got, label)
