"""Tier 3: block-causal (document) attention trains like one process under every parallelism.

The single-process run with ``model.attn_mask_type = block_causal`` is the reference; each
layout trains the same 10 steps on the same global batch and must match it step by step (loss
within 1e-5 relative, grad norm within 5e-4). The reference itself must differ from the causal
run, or the mask would not be doing anything. Batches carry document ids; FSDP and TP only pass
them through, PP splits them per microbatch and hands each stage its microbatch's ids, CP shards
them head-tail like the tokens and all-gathers them with K/V (docs/attention.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.checkpoint_helpers import assert_bitwise_resume
from tests.distributed.parity_cases import check_parity, reference_metrics
from tests.parity import assert_losses_match, assert_validation_match, losses, train_metrics

STEPS = 10
BLOCK = ["--model.attn_mask_type", "block_causal"]
DOC_POS = ["--training.document_positions"]
LB = "--training.local_batch_size"
CP = "--parallelism.context_parallel_degree"
TP = "--parallelism.tensor_parallel_degree"
FSDP = "--parallelism.data_parallel_shard_degree"
DOC_LB = ["--parallelism.context_parallel_load_balancer", "document"]
RING = ["--parallelism.context_parallel_method", "ring"]


def pp(schedule: str) -> list[str]:
    return [
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_schedule",
        schedule,
    ]


CASES = {
    # id: (world size, overrides, slow)
    "fsdp2": (2, [LB, "4"], False),
    "tp2": (2, [TP, "2", LB, "8"], False),
    "pp2_1f1b": (2, [*pp("1F1B"), LB, "8"], False),
    "pp2_interleaved": (2, [*pp("Interleaved1F1B"), LB, "8"], False),
    "cp2": (2, [CP, "2", LB, "8"], False),
    # One process: activation checkpointing recomputes the masked attention, and two
    # accumulation steps each carry their own document ids.
    "ac_full_accum2": (1, [LB, "4", "--activation_checkpoint.mode", "full"], False),
    "compile": (1, [LB, "8", "--compile.enable"], True),
    "fsdp2xtp2": (4, [FSDP, "2", TP, "2", LB, "4"], True),
    "pp2xfsdp2xcp2": (8, [*pp("1F1B"), FSDP, "2", CP, "2", LB, "4"], True),
    # Per-document head-tail sharding (docs/context_parallel.md): every sample's tokens are
    # permuted per its documents; tokens, labels, positions and ids move together.
    "cp2_document": (2, [CP, "2", *DOC_LB, LB, "8"], False),
    "cp4": (4, [CP, "4", LB, "8"], True),
    "cp4_document": (4, [CP, "4", *DOC_LB, LB, "8"], True),
    "fsdp2xcp2_document": (4, [FSDP, "2", CP, "2", *DOC_LB, LB, "4"], True),
    "tp2xcp2_document": (4, [TP, "2", CP, "2", *DOC_LB, LB, "8"], True),
    "pp2xcp2_document": (4, [*pp("1F1B"), CP, "2", *DOC_LB, LB, "8"], True),
    # Ring attention with the document mask (distributed/context_parallel/ring.py), both balancers.
    "cp2_ring": (2, [CP, "2", *RING, LB, "8"], True),
    "cp2_document_compile": (2, [CP, "2", *DOC_LB, LB, "8", "--compile.enable"], True),
    "cp2_ring_compile": (2, [CP, "2", *RING, LB, "8", "--compile.enable"], True),
    "cp4_ring_document": (4, [CP, "4", *RING, *DOC_LB, LB, "8"], True),
    "fsdp2xcp2_ring_document": (4, [FSDP, "2", CP, "2", *RING, *DOC_LB, LB, "4"], True),
    "tp2xcp2_ring": (4, [TP, "2", CP, "2", *RING, LB, "8"], True),
    "pp2xcp2_ring_document": (4, [*pp("1F1B"), CP, "2", *RING, *DOC_LB, LB, "8"], True),
}
_REFERENCE: dict[str, list[dict]] = {}


def block_reference(tmp_path_factory: pytest.TempPathFactory, extra: list[str]) -> list[dict]:
    key = " ".join(extra)
    if key not in _REFERENCE:
        dump = tmp_path_factory.mktemp("block_reference")
        _REFERENCE[key] = train_metrics([*BLOCK, *extra, LB, "8"], 1, dump, STEPS)
    return _REFERENCE[key]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    ref = block_reference(tmp_path_factory, [])
    causal = losses(reference_metrics(tmp_path_factory, steps=STEPS))
    diff = max(abs(a - b) / a for a, b in zip(losses(ref), causal))
    print(f"block_causal vs causal reference: max relative loss difference {diff:.3e}")
    assert diff > 1e-3, "block_causal trained exactly like causal: the mask is not applied"
    return ref


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, marks=pytest.mark.slow) if CASES[c][2] else c for c in CASES],
)
def test_block_causal_matches_single_process(
    reference: list[dict], tmp_path: Path, case: str
) -> None:
    world, overrides, _ = CASES[case]
    check_parity(reference, [*BLOCK, *overrides], world, tmp_path, label=f"block_causal {case}")


@pytest.mark.slow
@pytest.mark.parametrize("balancer", ["headtail", "document"])
def test_document_positions_cp2_matches_single_process(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, balancer: str
) -> None:
    """Per-document RoPE positions are computed on the whole sequence, then sharded by CP
    (under the document balancer, permuted with the tokens)."""
    ref = block_reference(tmp_path_factory, DOC_POS)
    lb = ["--parallelism.context_parallel_load_balancer", balancer]
    overrides = [*BLOCK, *DOC_POS, *lb, CP, "2", LB, "8"]
    label = f"block_causal + document positions, CP 2 {balancer}"
    check_parity(ref, overrides, 2, tmp_path, label=label)


def test_block_causal_bitwise_resume(tmp_path: Path) -> None:
    """One process, block_causal: 6 straight steps == 3 steps + resume + 3 steps, bit for bit
    (the data position includes nothing new: document ids are recomputed from the window)."""
    assert_bitwise_resume(tmp_path, 1, *BLOCK, LB, "8")


def test_block_causal_validation_loss_cp2_matches_single_process(tmp_path: Path) -> None:
    """Validation batches carry document ids too, sharded over cp like the training ones."""
    val = ["--validation.enable", "--validation.freq", "2", "--validation.steps", "2"]
    ref = train_metrics([*BLOCK, LB, "8", *val], 1, tmp_path / "ref", steps=2)
    got = train_metrics([*BLOCK, CP, "2", LB, "8", *val], 2, tmp_path / "cp", steps=2)
    assert_validation_match(ref, got, "block_causal CP 2 validation loss")


def test_block_causal_with_float8_stays_close_to_fp32(
    reference: list[dict], tmp_path: Path
) -> None:
    """float8 converts the linear layers only; with block_causal it stays within float8's
    rounding of the fp32 block_causal run (as causal float8 does, test_compile_float8.py)."""
    f8 = ["--quantize.dense.float8.enable", "--no-quantize.dense.float8.auto_filter_small_kn"]
    got = train_metrics([*BLOCK, *f8, LB, "8"], 1, tmp_path, STEPS)
    label = "block_causal float8 tensorwise vs fp32"
    worst = assert_losses_match(losses(reference), losses(got), rtol=5e-3, label=label)
    assert worst > 1e-6, "float8 losses equal fp32 exactly: were any layers converted?"


@pytest.mark.slow
def test_moe_ep2_cp2_document_balancer_matches_single_process(tmp_path: Path) -> None:
    """Expert parallel with the document balancer: DeepSeek-V3 (MoE, MTP) routes each token
    wherever CP put it; the sequence-wise auxiliary loss sums over cp, so the permutation
    leaves it unchanged."""
    moe = ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel", *BLOCK]
    moe += ["--model.moe_bias_update_rate", "0"]
    ref = train_metrics([*moe, LB, "8"], 1, tmp_path / "ref", STEPS)
    ep = ["--parallelism.expert_parallel_degree", "2"]
    overrides = [*moe, CP, "2", *ep, *DOC_LB, LB, "8"]
    check_parity(
        ref, overrides, 2, tmp_path / "cp", label="DeepSeek-V3 block_causal EP 2 x CP 2 document"
    )
