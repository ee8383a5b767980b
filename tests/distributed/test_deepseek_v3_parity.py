"""DeepSeek-V3 (debugmodel: MLA, one dense block then MoE blocks with sigmoid group-limited
routing, shared expert, auxiliary loss and routing bias, YaRN, one MTP module) under the
parallelisms its plan admits, against one process (fp32, same global batch, every step's loss
within 1e-5 relative, grad norms alike; docs/deepseek_v3.md), and a bitwise resume.

The MTP loss falls in the reference run, and with weight 0 the main losses equal a run without
MTP. Every case runs with MTP on and compares the logged MTP loss too: under pipeline parallel the
MTP module sits on the last stage (its input embeddings sent from the first), under context
parallel its shifted tokens are made before the sequence is sharded (docs/deepseek_v3.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest

import torchtitan.training.trainer  # noqa: F401  (imported once in the parent, not in every rank)
from tests.checkpoint_helpers import assert_bitwise_resume
from tests.distributed.parity_cases import PP2_1F1B, FamilyParity
from tests.parity import assert_losses_match, losses, train_metrics

STEPS = 10
FLAVOR = ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel"]
# FSDP, TP and EP run with the routing bias off: the choice is discontinuous, and with the
# sigmoid scores all near 0.5 this early plus biases moving in steps of 0.001, near-ties appear
# that a different summation order flips (measured: FSDP 2, TP 2 and EP 2 x FSDP 4 agree with
# each other and differ from one process by 4e-5 at step 10 with the bias on, by <= 4e-7 with
# it off). PP and CP run with it on (the flavor's 0.001): they match one process to <= 2e-7
# relative either way. The bitwise resume runs with it on: it is state a resume must restore.
MODEL = [*FLAVOR, "--model.moe_bias_update_rate", "0"]
NO_MTP = ["--model.mtp_depth", "0"]
PARITY = FamilyParity(MODEL, STEPS)
BIAS_ON = FamilyParity(FLAVOR, STEPS)
"""The flavor's routing-bias update (0.001 a step) on."""


def _compare(
    tmp_path_factory: pytest.TempPathFactory,
    tmp_path: Path,
    world: int,
    overrides: list[str],
    label: str,
    parity: FamilyParity = PARITY,
) -> None:
    """The shared comparison, the logged MTP loss too (rank 0's: under PP the first stage's
    rank, which holds no MTP module and logs the last stage's value)."""
    ref, got = parity.compare(tmp_path_factory, tmp_path, world, overrides, label)
    ref_mtp, got_mtp = [m["mtp/loss"] for m in ref], [m["mtp/loss"] for m in got]
    assert_losses_match(ref_mtp, got_mtp, rtol=1e-5, label=f"{label} (MTP loss)")


def test_fsdp2(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    _compare(tmp_path_factory, tmp_path, 2, ["--training.local_batch_size", "4"], "FSDP 2")
    mtp = [m["mtp/loss"] for m in PARITY.reference(tmp_path_factory)]
    print(f"MTP loss {mtp[0]:.3f} -> {mtp[-1]:.3f}")
    assert mtp[-1] < mtp[0] - 0.3, mtp


@pytest.mark.slow
def test_mtp_weight_zero_equals_no_mtp(tmp_path: Path) -> None:
    """Bit for bit with clipping off (``max_norm 0``): the global grad norm sums the MTP
    modules' zero gradients too, which changes its rounding, and with it a clipped step's."""
    argv = [*MODEL, "--training.local_batch_size", "8", "--training.max_norm", "0"]
    ref = train_metrics([*argv, *NO_MTP], 1, tmp_path / "no_mtp", STEPS)
    got = train_metrics([*argv, "--model.mtp_loss_weight", "0"], 1, tmp_path / "zero", STEPS)
    assert losses(got) == losses(ref), (losses(got), losses(ref))
    assert all(m["mtp/loss"] > 0 for m in got)  # computed (and logged), not trained


LB = "--training.local_batch_size"
PP2_INTERLEAVED = ["--parallelism.pipeline_parallel_degree", "2"]
PP2_INTERLEAVED += ["--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"]
# (ranks, overrides, reference). Every case with MTP on. PP: the MTP module on the last stage,
# the routing bias stepping: torch's pipeline stage runs a metadata forward of its own before
# the first step, in eval mode here (``distributed/pipeline_parallel.py: _Stage``), so the MoE
# layers count only the training forwards' load (without that: docs/deepseek_v3.md).
SLOW_CASES = {
    "TP 2": (2, ["--parallelism.tensor_parallel_degree", "2", LB, "8"], PARITY),
    "PP 2": (2, [*PP2_1F1B, LB, "8"], BIAS_ON),
    "PP 2 frozen bias": (2, [*PP2_1F1B, LB, "8"], PARITY),
    "PP 2 interleaved": (2, [*PP2_INTERLEAVED, LB, "8"], BIAS_ON),
    "EP 2 x FSDP 4": (4, ["--parallelism.expert_parallel_degree", "2", LB, "2"], PARITY),
    "CP 2": (2, ["--parallelism.context_parallel_degree", "2", LB, "8"], BIAS_ON),
}


@pytest.mark.slow
@pytest.mark.parametrize("label", list(SLOW_CASES))
def test_parallelism(label: str, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    world, overrides, parity = SLOW_CASES[label]
    _compare(tmp_path_factory, tmp_path, world, overrides, label, parity)


@pytest.mark.slow
def test_fsdp2_bitwise_resume(tmp_path: Path) -> None:
    """6 straight steps == 3 steps + resume + 3 steps, bit for bit (losses, grad norms, every
    entry of the step-6 checkpoint: MTP weights and routing biases included)."""
    n = assert_bitwise_resume(tmp_path, 2, *FLAVOR, "--training.local_batch_size", "4")
    print(f"FSDP 2: 3 steps + resume + 3 steps == 6 steps; {n} entries identical")
