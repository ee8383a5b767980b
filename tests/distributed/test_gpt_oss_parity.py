"""GPT-OSS under the parallelisms its plan allows, against one process (fp32, same global batch,
10 steps, every step's loss within 1e-5 relative and the grad norms matching; docs/gpt_oss.md).

The debug flavor has 4 blocks (sliding window 32, full, sliding, full) at sequence length 64,
so the windows cut; every block is MoE (8 biased experts, top-2). FSDP 2 is the fast case; TP 2
(heads, their biases and sinks split), EP 2 (experts and their biases split), block-causal
document masking under FSDP 2 and the bitwise resume are slow.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import torchtitan.training.trainer  # noqa: F401  (imported once in the parent, not in every rank)
from tests.checkpoint_helpers import assert_bitwise_resume
from tests.distributed.parity_cases import PP2_1F1B, FamilyParity
from tests.launcher import run_ranks
from tests.parity import TINY, _train, assert_losses_close_but_changed, losses, train_metrics

STEPS = 10
MODEL = ["--model.name", "gpt_oss", "--model.flavor", "debugmodel"]
LB = "--training.local_batch_size"
BLOCK = ["--model.attn_mask_type", "block_causal"]
PARITY = FamilyParity(MODEL, STEPS)
_compare = PARITY.compare


def test_fsdp2(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    _compare(tmp_path_factory, tmp_path, 2, [LB, "4"], "GPT-OSS FSDP 2")


@pytest.mark.slow
def test_tp2(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    overrides = ["--parallelism.tensor_parallel_degree", "2", LB, "8"]
    _compare(tmp_path_factory, tmp_path, 2, overrides, "GPT-OSS TP 2")


@pytest.mark.slow
def test_ep2(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    overrides = ["--parallelism.expert_parallel_degree", "2", LB, "4"]
    _compare(tmp_path_factory, tmp_path, 2, overrides, "GPT-OSS EP 2")


@pytest.mark.slow
def test_block_causal_fsdp2(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    causal = PARITY.reference(tmp_path_factory)
    block = PARITY.reference(tmp_path_factory, tuple(BLOCK))
    assert losses(block) != losses(causal), "the document mask changed nothing"
    label = "GPT-OSS block_causal FSDP 2"
    _compare(tmp_path_factory, tmp_path, 2, [LB, "4"], label, tuple(BLOCK))


@pytest.mark.slow
def test_fsdp2_bitwise_resume(tmp_path: Path) -> None:
    """6 straight steps == 3 steps + resume from the step-3 checkpoint + 3 steps, bit for bit
    (losses, grad norms, every entry of the step-6 checkpoint)."""
    n = assert_bitwise_resume(tmp_path, 2, *MODEL, LB, "4")
    print(f"GPT-OSS FSDP 2: 3 steps + resume + 3 steps == 6 steps; {n} entries identical")


@pytest.mark.slow
def test_pp2(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    overrides = [*PP2_1F1B, LB, "8"]
    _compare(tmp_path_factory, tmp_path, 2, overrides, "GPT-OSS PP 2")


@pytest.mark.slow
def test_compile_and_full_ac(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    """Per-block compile (the routed experts run eagerly in fp32: one graph break per block)
    with full activation checkpointing, on one process (measured 1.2e-7 from eager)."""
    from tests.distributed.test_compile_float8 import COMPILE

    ref = losses(PARITY.reference(tmp_path_factory))
    overrides = [*COMPILE, "--activation_checkpoint.mode", "full", LB, "8"]
    argv = [*TINY, "--training.steps", str(STEPS), *MODEL, *overrides]
    # A long timeout: a cold compile on a busy 2-core machine can take minutes.
    results = run_ranks(_train, 1, argv, str(tmp_path), timeout=900)
    got = losses(results[0])
    assert_losses_close_but_changed(ref, got, 1e-5, "GPT-OSS compile + full AC")


@pytest.mark.slow
def test_float8_trains_close_to_fp32(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """Float8 (emulated on CPU) converts the biased attention projections only (the MoE layer
    is exempt): within float8's tolerance of fp32, not equal to it."""
    from tests.distributed.test_compile_float8 import FLOAT8, FLOAT8_RTOL

    ref = losses(PARITY.reference(tmp_path_factory))
    got = losses(train_metrics([*MODEL, *FLOAT8, LB, "8"], 1, tmp_path, STEPS))
    why = "float8 losses equal fp32 exactly: were the attention linears converted?"
    assert_losses_close_but_changed(ref, got, FLOAT8_RTOL, "GPT-OSS float8 vs fp32", 1e-6, why)
