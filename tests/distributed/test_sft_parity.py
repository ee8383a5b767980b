"""Chat SFT: the loss normalised by the unmasked tokens of the global batch is the same under
data parallel, gradient accumulation and pipeline microbatching, although ranks and
microbatches hold very different numbers of trained tokens (docs/sft.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.checkpoint_helpers import assert_bitwise_resume
from tests.distributed.parity_cases import assert_grad_norms_match
from tests.parity import (
    PP2_1F1B,
    ROOT,
    assert_losses_match,
    assert_validation_match,
    losses,
    train_metrics,
)
from torchtitan.data.chat_data import ChatDataset
from torchtitan.data.tokenizer import build_tokenizer
from torchtitan.loss.cross_entropy import IGNORE_INDEX

STEPS = 6
SEQ = 128
CHAT = [
    "--training.dataset",
    "chat",
    "--training.dataset_path",
    str(ROOT / "tests" / "assets" / "chat" / "train.jsonl"),
    "--sft.packing",
    "pad",  # one conversation per row: 4 to 46 trained tokens each
    "--training.seq_len",
    str(SEQ),
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    dump = tmp_path_factory.mktemp("sft_reference")
    return train_metrics([*CHAT, "--training.local_batch_size", "8"], 1, dump, STEPS)


def _trained_per_row() -> list[int]:
    ds = ChatDataset(CHAT[3], build_tokenizer("tests/assets/tokenizer"), SEQ, packing="pad")
    it = iter(ds)
    return [int((next(it)[1] != IGNORE_INDEX).sum()) for _ in range(8 * STEPS)]


def test_ranks_and_microbatches_hold_uneven_token_counts() -> None:
    """The premise of the cases below: a per-rank or per-microbatch mean would differ."""
    rows = torch.tensor(_trained_per_row()).view(STEPS, 8)
    dp_rank0, dp_rank1 = rows[:, 0::2].sum(1), rows[:, 1::2].sum(1)  # dp 2, 4 rows each
    assert (dp_rank0 != dp_rank1).all(), (dp_rank0, dp_rank1)
    micro = rows.view(STEPS, 4, 2).sum(-1)  # 4 accumulation microbatches of 2 rows
    assert (micro.max(1).values > 2 * micro.min(1).values).any(), micro


def _compare(
    reference: list[dict], overrides: list[str], world: int, dump: Path, label: str
) -> None:
    got = train_metrics([*CHAT, *overrides], world, dump, STEPS)
    assert_losses_match(losses(reference), losses(got), rtol=1e-5, label=label)
    assert_grad_norms_match(reference, got, label)
    assert losses(reference)[-1] < losses(reference)[0] - 0.5, losses(reference)


def test_sft_fsdp2_matches_single_process(reference: list[dict], tmp_path: Path) -> None:
    _compare(reference, ["--training.local_batch_size", "4"], 2, tmp_path, "SFT FSDP 2")


@pytest.mark.slow
def test_sft_grad_accumulation_4_matches(reference: list[dict], tmp_path: Path) -> None:
    _compare(reference, ["--training.local_batch_size", "2"], 1, tmp_path, "SFT accum x4")


@pytest.mark.slow
def test_sft_pp2_microbatches_match(reference: list[dict], tmp_path: Path) -> None:
    microbatches = ["--parallelism.pipeline_parallel_microbatches", "4"]
    overrides = ["--training.local_batch_size", "8", *PP2_1F1B, *microbatches]
    _compare(reference, overrides, 2, tmp_path, "SFT PP 2 (4 microbatches)")


@pytest.mark.slow
@pytest.mark.parametrize(
    "axis", ["context_parallel_degree", "tensor_parallel_degree"], ids=["cp2", "tp2"]
)
def test_sft_cp2_tp2_match(reference: list[dict], tmp_path: Path, axis: str) -> None:
    """CP ranks hold uneven trained-token shares of each sequence; TP's loss parallel sums."""
    overrides = ["--training.local_batch_size", "8", f"--parallelism.{axis}", "2"]
    _compare(reference, overrides, 2, tmp_path, f"SFT {axis} 2")


@pytest.mark.slow
def test_sft_resume_is_bitwise(tmp_path: Path) -> None:
    """FSDP 2, packed conversations under block_causal: 6 steps straight equal 3 steps, a
    restart from the step-3 checkpoint and 3 more steps (losses, grad norms, checkpoint)."""
    packed = [*CHAT, "--sft.packing", "pack", "--model.attn_mask_type", "block_causal"]
    n = assert_bitwise_resume(tmp_path, 2, *packed, "--training.local_batch_size", "4")
    print(f"SFT FSDP 2: resume from step 3 == straight; {n} checkpoint entries identical")


@pytest.mark.slow
def test_sft_validation_loss_pp2_matches_single_process(tmp_path: Path) -> None:
    """Validation on chat data counts only the trained tokens, under PP too."""
    val = ["--validation.enable", "--validation.dataset", "chat", "--validation.freq", "2"]
    val += ["--validation.dataset_path", str(ROOT / "tests/assets/chat/validation.jsonl")]
    base = [*CHAT, *val, "--training.local_batch_size", "8"]
    ref = train_metrics(base, 1, tmp_path / "ref", steps=2)
    pp2 = ["--parallelism.pipeline_parallel_degree", "2", "--metrics.save_for_all_ranks"]
    got = train_metrics([*base, *pp2], 2, tmp_path / "pp", steps=2)
    rows = assert_validation_match(ref, got, "SFT PP 2 validation loss")
    trained = sum(
        int((lab != IGNORE_INDEX).sum())
        for _, lab in ChatDataset(
            val[-1], build_tokenizer("tests/assets/tokenizer"), SEQ, packing="pad", infinite=False
        )
    )
    # 40 conversations, 5 full batches of 8: every trained token of the split is counted
    assert rows[0][0]["validation/tokens"] == trained
