"""What MFU counts (planner/lora_memory.py, docs/observability.md "What MFU counts"): the matmul FLOPs
that torch's own FLOP counter sees in one forward and backward, for full training and for a
frozen base with LoRA adapters (no weight gradients for the base: ``4 N + 6 n``, not ``6 N``)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from tests.tiny_args import tiny_llama3
from torchtitan.config.manager import parse_args
from torchtitan.lora.apply import apply_lora, init_adapters
from torchtitan.models import MODELS
from torchtitan.planner.lora_memory import training_flops_per_token

SEQ = 32
ARGS = tiny_llama3(dim=128, heads=(8, 4), vocab=512, n_layers=8, max_seq_len=SEQ)
LORA = [
    "--lora.enable",
    "--lora.rank",
    "8",
    "--lora.target_modules",
    "attention.w*,feed_forward.w*",
]


def _counted_matmul_flops_per_token(lora: bool) -> float:
    cfg = parse_args(["--model.name", "llama3", "--training.seq_len", str(SEQ)])
    model = MODELS["llama3"].build(ARGS)
    model.init_weights(seed=0)
    if lora:
        apply_lora(model, parse_args(LORA).lora)
        init_adapters(model, seed=0)
    tokens = torch.randint(0, ARGS.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model(tokens).float().sum().backward()
    del cfg
    return counter.get_total_flops() / SEQ


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_flops_per_token_match_torch_flop_counter(lora: bool) -> None:
    cfg = parse_args(["--model.name", "llama3", "--training.seq_len", str(SEQ), *(LORA * lora)])
    ours = training_flops_per_token(cfg, ARGS)
    # The CPU attention kernel is not one the FLOP counter knows: compare the matmuls only.
    attention = 12 * ARGS.n_layers * ARGS.n_heads * ARGS.head_dim * SEQ
    counted = _counted_matmul_flops_per_token(lora)
    rel = abs(ours - attention - counted) / counted
    print(f"{'lora' if lora else 'full'}: ours {ours - attention:,.0f} counted {counted:,.0f}")
    # Full: the norms' weights (counted in N, no matmul) are 0.1%. LoRA: the first block's
    # query/key/value projections need no input gradient either (the embedding is frozen),
    # which the count leaves in: 0.8% of this 8-block model (one block's share: less when deeper).
    assert rel < (0.002 if not lora else 0.01), rel


def test_lora_counts_fewer_flops_than_full_training() -> None:
    base = ["--model.name", "llama3", "--training.seq_len", str(SEQ)]
    full = training_flops_per_token(parse_args(base), ARGS)
    lora = training_flops_per_token(parse_args([*base, *LORA]), ARGS)
    assert 0.6 < lora / full < 0.8, (lora, full)
