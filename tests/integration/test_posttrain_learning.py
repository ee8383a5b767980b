"""Post-training learns (docs/posttrain.md, "It learns"; slow): on the synthetic arithmetic sets
of ``scripts/make_posttrain_data.py`` with a tiny Llama on bytes,

DPO raises the policy's preference accuracy (log p(chosen) > log p(rejected)) on its training
pairs by a measured margin (held-out pairs are printed too); GRPO raises the greedy exact-match
rate of an SFT'd policy on another seed's prompts, for two seeds. The figures are printed and
recorded in docs/posttrain.md."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from scripts.make_posttrain_data import write
from tests.posttrain_helpers import CharTokenizer, tiny_model
from torchtitan.data.chat_template import tokenize_conversation
from torchtitan.loss.cross_entropy import IGNORE_INDEX
from torchtitan.posttrain.dpo import DpoSettings, DpoStep
from torchtitan.posttrain.grpo import GrpoSettings, GrpoStep, greedy_reward, read_prompts
from torchtitan.posttrain.logprobs import sequence_logprobs
from torchtitan.posttrain.preference_data import PreferenceDataset, preference_batches
from torchtitan.posttrain.reference import Reference
from torchtitan.posttrain.rewards import exact_match

pytestmark = pytest.mark.slow

DPO_STEPS = 60
SFT_STEPS, GRPO_STEPS = 200, 150


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


def _sft(model: torch.nn.Module, path: Path, steps: int, rng: random.Random) -> float:
    """The warm-up: ``steps`` AdamW (lr 3e-3) steps of 16 conversations on their assistant tokens."""
    rows = []
    for line in path.read_text().splitlines():
        ids, train = tokenize_conversation(CharTokenizer(), json.loads(line)["messages"], None)
        labels = [t if m else IGNORE_INDEX for t, m in zip(ids, train, strict=True)]
        rows.append((torch.tensor(ids[:-1]), torch.tensor(labels[1:])))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        batch = rng.sample(rows, 16)
        width = max(len(x) for x, _ in batch)
        x = torch.stack([F.pad(x, (0, width - len(x))) for x, _ in batch])
        y = torch.stack([F.pad(y, (0, width - len(y)), value=IGNORE_INDEX) for _, y in batch])
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.item()


@pytest.fixture
def one_thread() -> Iterator[None]:
    """The tiny model's ops are too small to share: with two threads on a loaded 2-core machine
    both seeds had not finished after 17 minutes; with one they took 42 s."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("seed", [0, 1])
def test_grpo_raises_greedy_exact_match(tmp_path: Path, seed: int, one_thread: None) -> None:
    write(tmp_path / "train", 200, 0, 4)  # single-digit sums: the answer is one token, then EOS
    write(tmp_path / "held_out", 100, 1, 4)
    tok, cpu, rng = CharTokenizer(), torch.device("cpu"), random.Random(seed)
    train = read_prompts(tmp_path / "train" / "prompts.jsonl", tok, 64, 2)
    held = read_prompts(tmp_path / "held_out" / "prompts.jsonl", tok, 64, 2)
    model = tiny_model(seed, dim=64)
    sft_loss = _sft(model, tmp_path / "train" / "sft.jsonl", SFT_STEPS, rng)
    before = greedy_reward(model, held, tok, exact_match, 2, cpu)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99))
    step = GrpoStep([model], opt, _constant(opt), GrpoSettings(k=8, max_new_tokens=2), [exact_match], [1.0], tok,
                    None, None, cpu, torch.Generator().manual_seed(seed))  # fmt: skip
    means = [step.run(rng.sample(train, 16))["reward_mean"] for _ in range(GRPO_STEPS)]
    after = greedy_reward(model, held, tok, exact_match, 2, cpu)
    print(
        f"GRPO seed {seed}: SFT loss {sft_loss:.3f}; greedy exact match on 100 held-out prompts "
        f"{before:.2f} -> {after:.2f} in {GRPO_STEPS} steps; sampled reward mean per 50 steps "
        f"{[round(sum(means[i : i + 50]) / 50, 3) for i in range(0, GRPO_STEPS, 50)]}"
    )
    assert after >= before + 0.05, (before, after)
