"""Qwen3.5 under every layout its plan allows, against one process (fp32, same global batch,
every step's loss within 1e-5 relative over 10 steps; docs/architecture.md, promise 1;
docs/qwen3_5.md).

The debug flavor has DeltaNet layers 0-2 and a full-attention layer 3, so every case runs both
mixers. Under TP 2 the DeltaNet's heads, its convolution channels and its decay parameters are
sharded (each rank runs the recurrence of its own heads); under PP 2 the stages split the
layer kinds; the MoE flavor (8 experts, top-2, the sigmoid-gated shared expert) runs under EP.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import torchtitan.training.trainer  # noqa: F401  (imported once in the parent, not in every rank)
from tests.distributed.parity_cases import FamilyParity
from tests.launcher import run_ranks
from tests.parity import (
    TINY,
    _train,
    assert_losses_close_but_changed,
    assert_losses_match,
    losses,
    train_metrics,
)
from tests.torch_window import schedule_params

STEPS = 10
MODEL = ["--model.name", "qwen3_5"]
PARITY = FamilyParity(MODEL, STEPS)

LB = "--training.local_batch_size"
TP2 = ["--parallelism.tensor_parallel_degree", "2", LB, "8"]
BLOCK = ("--model.attn_mask_type", "block_causal")


def _pp(schedule: str) -> list[str]:
    """PP 2 with ``schedule`` (the plan decides the stages per rank; docs/pipeline.md)."""
    return [
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_schedule",
        schedule,
        LB,
        "8",
    ]


def _ep(ep: int, local_batch: int, *extra: str) -> list[str]:
    return ["--parallelism.expert_parallel_degree", str(ep), LB, str(local_batch), *extra]


def _compare(
    flavor: str,
    tmp_path_factory: pytest.TempPathFactory,
    tmp_path: Path,
    world: int,
    overrides: list[str],
    label: str,
    extra: tuple[str, ...] = (),
) -> None:
    flavor_args = ("--model.flavor", flavor, *extra)
    PARITY.compare(tmp_path_factory, tmp_path, world, overrides, label, flavor_args)


def test_tp2(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    """TP 2 with sequence and loss parallel: DeltaNet heads and convolution channels sharded."""
    _compare("debugmodel", tmp_path_factory, tmp_path, 2, TP2, "Qwen3.5 TP 2")


# label -> (flavor, ranks, overrides)
SLOW_CASES = {
    "Qwen3.5 FSDP 2": ("debugmodel", 2, [LB, "4"]),
    "Qwen3.5 HSDP 2 x 2": (
        "debugmodel",
        4,
        ["--parallelism.data_parallel_replicate_degree", "2", LB, "2"],
    ),
    "Qwen3.5 FSDP 2 x TP 2": ("debugmodel", 4, [*TP2[:2], LB, "4"]),
    "Qwen3.5 chunked loss TP 2": ("debugmodel", 2, [*TP2, "--training.loss_chunk_size", "100"]),
    "Qwen3.5 full AC FSDP 2": ("debugmodel", 2, ["--activation_checkpoint.mode", "full", LB, "4"]),
    "Qwen3.5-MoE FSDP 2": ("debugmodel_moe", 2, [LB, "4"]),
    "Qwen3.5-MoE EP 2": ("debugmodel_moe", 2, _ep(2, 4)),
    "Qwen3.5-MoE EP 2 x FSDP 2": ("debugmodel_moe", 4, _ep(2, 2)),
    "Qwen3.5-MoE TP 2": ("debugmodel_moe", 2, TP2),
    "Qwen3.5-MoE EP 2 x TP 2": ("debugmodel_moe", 4, _ep(2, 4, *TP2[:2])),
    "Qwen3.5-MoE PP 2": ("debugmodel_moe", 2, _pp("1F1B")),
}


@pytest.mark.slow
@pytest.mark.parametrize("label", list(SLOW_CASES))
def test_parallelism(label: str, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    flavor, world, overrides = SLOW_CASES[label]
    _compare(flavor, tmp_path_factory, tmp_path, world, overrides, label)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", schedule_params())
def test_pp2_every_schedule(
    schedule: str, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """Every schedule the other families run; the stages split the two layer kinds."""
    _compare("debugmodel", tmp_path_factory, tmp_path, 2, _pp(schedule), f"Qwen3.5 PP 2 {schedule}")


@pytest.mark.slow
def test_block_causal_fsdp2_tp2(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    """Packed documents (the DeltaNet state and convolution reset at each document) under
    FSDP 2 x TP 2 against one process with the same mask; the mask changes the losses."""
    causal = PARITY.reference(tmp_path_factory, ("--model.flavor", "debugmodel"))
    block = PARITY.reference(tmp_path_factory, ("--model.flavor", "debugmodel", *BLOCK))
    assert losses(block) != losses(causal), "the document mask changed nothing"
    overrides = [*TP2[:2], LB, "4"]
    _compare("debugmodel", tmp_path_factory, tmp_path, 4, overrides, "block_causal", BLOCK)


@pytest.mark.slow
def test_compile_and_full_ac(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    """Per-block compile with full activation checkpointing, one process, against eager."""
    from tests.distributed.test_compile_float8 import COMPILE

    ref = losses(PARITY.reference(tmp_path_factory, ("--model.flavor", "debugmodel")))
    overrides = [*COMPILE, "--activation_checkpoint.mode", "full", LB, "8"]
    argv = [*TINY, "--training.steps", str(STEPS), *MODEL, "--model.flavor", "debugmodel"]
    results = run_ranks(_train, 1, [*argv, *overrides], str(tmp_path), timeout=900)
    assert_losses_close_but_changed(ref, losses(results[0]), 1e-5, "Qwen3.5 compile + full AC")


@pytest.mark.slow
def test_float8(tmp_path: Path) -> None:
    """Float8 (emulated on CPU) on every linear of both mixers, against one float8 process:
    within 5e-4 under TP 2 and FSDP 2, not 1e-5: tensorwise dynamic scales take an activation's
    amax where it lives, so a row-sharded projection's input (TP) or a rank's half of the batch
    (FSDP) is scaled by its own amax (measured 1.0e-4 and 2.0e-4; the shared float8 tests allow
    1e-4 to 1e-3, tests/distributed/test_compile_float8.py); and float8 is not fp32."""
    from tests.distributed.test_compile_float8 import FLOAT8, FLOAT8_RTOL

    argv = [*MODEL, "--model.flavor", "debugmodel", *FLOAT8]
    one = losses(train_metrics([*argv, LB, "8"], 1, tmp_path / "one", STEPS))
    tp = losses(train_metrics([*argv, *TP2], 2, tmp_path / "tp", STEPS))
    assert_losses_match(one, tp, rtol=5e-4, label="Qwen3.5 float8 TP 2 vs 1 rank")
    fsdp = losses(train_metrics([*argv, LB, "4"], 2, tmp_path / "fsdp", STEPS))
    assert_losses_match(one, fsdp, rtol=5e-4, label="Qwen3.5 float8 FSDP 2 vs 1 rank")
    fp32 = losses(
        train_metrics(
            [*MODEL, "--model.flavor", "debugmodel", LB, "8"], 1, tmp_path / "fp32", STEPS
        )
    )
    why = "float8 losses equal fp32 exactly: were the linears converted?"
    assert_losses_close_but_changed(fp32, one, FLOAT8_RTOL, "Qwen3.5 float8 vs fp32", 1e-6, why)


CP = "--parallelism.context_parallel_degree"
DOC_LB = ("--parallelism.context_parallel_load_balancer", "document")
# label -> (ranks, overrides, flavor extra): Qwen3.5 under context parallel
# (docs/context_parallel.md, "Linear attention (Gated DeltaNet) under context parallel"). The
# DeltaNet layers' state and convolution window cross the CP ranks in sequence order; the test
# corpus's documents (3-480 tokens) cross the shard boundaries (chunks of 16 tokens at CP 2).
CP_CASES = {
    "Qwen3.5 block_causal CP 2 document": (2, [CP, "2", *DOC_LB, LB, "8"], BLOCK, False),
    "Qwen3.5 CP 2 causal": (2, [CP, "2", LB, "8"], (), True),
    "Qwen3.5 block_causal CP 4 headtail": (4, [CP, "4", LB, "8"], BLOCK, True),
    "Qwen3.5 block_causal CP 4 document": (4, [CP, "4", *DOC_LB, LB, "8"], BLOCK, True),
    "Qwen3.5 block_causal TP 2 x CP 2": (4, [*TP2[:2], CP, "2", LB, "8"], BLOCK, True),
    "Qwen3.5 block_causal PP 2 x CP 2 document": (
        4,
        [*_pp("1F1B")[:4], CP, "2", *DOC_LB, LB, "8"],
        BLOCK,
        True,
    ),
    "Qwen3.5 block_causal FSDP 2 x CP 2 document": (
        4,
        ["--parallelism.data_parallel_shard_degree", "2", CP, "2", *DOC_LB, LB, "4"],
        BLOCK,
        True,
    ),
}


@pytest.mark.parametrize(
    "label",
    [pytest.param(c, marks=pytest.mark.slow) if CP_CASES[c][3] else c for c in CP_CASES],
)
def test_context_parallel(
    label: str, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    world, overrides, extra, _ = CP_CASES[label]
    _compare("debugmodel", tmp_path_factory, tmp_path, world, overrides, label, extra)
