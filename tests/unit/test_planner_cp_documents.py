"""The planner costs context parallel with packed documents by the load balancer's own cost
(``layout.window_imbalance``; docs/context_parallel.md, "Load balancing packed documents"):
the slowest cp rank's attention sets the step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from torchtitan.config.manager import parse_args
from torchtitan.distributed.context_parallel.layout import window_imbalance
from torchtitan.planner.__main__ import main as plan_main
from torchtitan.planner.cost_model import cp_attention_imbalance, step_time
from torchtitan.planner.estimator import model_args_for
from torchtitan.planner.layout import Hardware, Layout

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "train_configs" / "llama3_8b.toml")
SEQ = 8192


def _long_tail(n: int = 2000) -> tuple[int, ...]:
    """Pareto lengths (shape 1.1, scale 128), capped at the sequence: a few long documents."""
    u = torch.rand(n, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return tuple((128 / u ** (1 / 1.1)).clamp(max=SEQ).long().tolist())


def _step(mask: str, balancer: str, cp: int, lengths: tuple[int, ...]) -> tuple[Any, dict]:
    cfg = parse_args(
        [
            *("--job.config_file", CONFIG, "--training.seq_len", str(SEQ)),
            *("--model.attn_mask_type", mask),
            *("--parallelism.context_parallel_load_balancer", balancer),
        ]
    )
    args = model_args_for(cfg, vocab_size=128256)
    lay = Layout(1, 8 // cp, 1, 1, cp, "full", "", 1, 8)
    hw = Hardware(memory_gib=80, document_lengths=lengths)
    return cfg, step_time(cfg, args, lay, hw, 8)[1]


def test_cp_skew_is_the_balancers_cost() -> None:
    """Long-tail documents under block_causal: head-tail's slowest rank pays the attention
    times (max/mean - 1) of the balancer's per-rank pairs; the document balancer pays far
    less; causal attention, CP 1 or no lengths pay nothing."""
    lengths = _long_tail()
    cfg, head = _step("block_causal", "headtail", 4, lengths)
    want = float(window_imbalance(lengths, SEQ, 4, "headtail").mean())
    assert cp_attention_imbalance(cfg, Hardware(80, document_lengths=lengths), 4) == want
    assert want > 1.2, want  # long tails: a few documents, head-tail is uneven
    args = model_args_for(cfg, vocab_size=128256)
    peak = 989.4e12 * 0.5
    attention = 8 * SEQ / 8 * 12 * args.n_layers * args.n_heads * args.head_dim * SEQ / peak
    assert head["cp_attention_skew"] == pytest.approx(attention * (want - 1), rel=1e-9)
    _, doc = _step("block_causal", "document", 4, lengths)
    assert 0 < doc["cp_attention_skew"] < head["cp_attention_skew"] / 5
    assert _step("causal", "headtail", 4, lengths)[1]["cp_attention_skew"] == 0
    assert _step("block_causal", "headtail", 1, lengths)[1]["cp_attention_skew"] == 0
    assert _step("block_causal", "headtail", 4, ())[1]["cp_attention_skew"] == 0


@pytest.mark.parametrize(
    "content, words",
    [("300\n9000\n12", "document of 9000 tokens"), ("300, x", "positive integers"), ("", "")],
)
def test_bad_document_lengths_is_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, words: str
) -> None:
    """A document longer than the sequence, a word that is not a length, an empty file."""
    path = tmp_path / "lengths.txt"
    path.write_text(content)
    argv = ["--world_size", "8", "--device_memory_gib", "80", "--document_lengths", str(path)]
    argv += ["--job.config_file", CONFIG, "--training.seq_len", str(SEQ)]
    assert plan_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--document_lengths" in err[0] and words in err[0], err
