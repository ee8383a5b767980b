"""Post-training learns (docs/posttrain.md, "It learns"; slow): on the synthetic arithmetic sets
of ``scripts/make_posttrain_data.py`` with a tiny Llama on bytes,

DPO raises the policy's preference accuracy (log p(chosen) > log p(rejected)) on its training
pairs by a measured margin (held-out pairs are printed too). The figures are printed and recorded in docs/posttrain.md."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from scripts.make_posttrain_data import write
from tests.posttrain_helpers import CharTokenizer, tiny_model
from torchtitan.posttrain.dpo import DpoSettings, DpoStep
from torchtitan.posttrain.logprobs import sequence_logprobs
from torchtitan.posttrain.preference_data import PreferenceDataset, preference_batches
from torchtitan.posttrain.reference import Reference

pytestmark = pytest.mark.slow

DPO_STEPS = 60


def _constant(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)


def _preference_accuracy(model: torch.nn.Module, ds: PreferenceDataset) -> float:
    with torch.no_grad():
        c_in, c_lab, r_in, r_lab = (
            torch.stack(col) for col in zip(*(ds.row(i) for i in range(len(ds))), strict=True)
        )
        c, _ = sequence_logprobs(model(c_in), c_lab)
        r, _ = sequence_logprobs(model(r_in), r_lab)
    return (c > r).float().mean().item()


def test_dpo_raises_preference_accuracy(tmp_path: Path) -> None:
    write(tmp_path / "train", 64, 0, 9)
    write(tmp_path / "held_out", 100, 1, 9)
    tok = CharTokenizer()
    train = PreferenceDataset(tmp_path / "train" / "preference.jsonl", tok, 64)
    seen = PreferenceDataset(tmp_path / "train" / "preference.jsonl", tok, 64, infinite=False)
    held = PreferenceDataset(tmp_path / "held_out" / "preference.jsonl", tok, 64, infinite=False)
    model = tiny_model(0, dim=64)
    before, held_before = _preference_accuracy(model, seen), _preference_accuracy(model, held)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    step = DpoStep([model], opt, _constant(opt), DpoSettings("sigmoid", beta=0.1), Reference([model]), None,
                   torch.device("cpu"))  # fmt: skip
    batches = preference_batches(train, 16)
    for _ in range(DPO_STEPS):
        metrics = step.run([next(batches)])
    after, held_after = _preference_accuracy(model, seen), _preference_accuracy(model, held)
    print(
        f"DPO: preference accuracy on the 64 training pairs {before:.2f} -> {after:.2f}, on 100 "
        f"held-out pairs {held_before:.2f} -> {held_after:.2f}, in {DPO_STEPS} steps; last {metrics}"
    )
    assert after >= before + 0.2, (before, after)
