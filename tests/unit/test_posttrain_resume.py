"""Post-training state round-trips bitwise (docs/posttrain.md, "Resume"): DPO with a frozen-copy
reference, stopped after 2 of 4 steps and restored into fresh objects (model, optimizer, the
reference's shards, the data position) ends bitwise equal to 4 straight steps; GRPO likewise with
the generator's state (its completions depend on it)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch

from scripts.make_posttrain_data import write
from tests.posttrain_helpers import CharTokenizer, tiny_model
from torchtitan.posttrain.dpo import DpoSettings, DpoStep
from torchtitan.posttrain.grpo import GrpoSettings, GrpoStep, read_prompts
from torchtitan.posttrain.preference_data import PreferenceDataset, preference_batches
from torchtitan.posttrain.reference import Reference
from torchtitan.posttrain.rewards import exact_match


def _roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _dpo(path: Path, seed: int) -> tuple[torch.nn.Module, DpoStep, PreferenceDataset]:
    model = tiny_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    step = DpoStep(
        [model], opt, sched, DpoSettings(), Reference([model]), None, torch.device("cpu")
    )
    return model, step, PreferenceDataset(path, CharTokenizer(), 64)


def test_dpo_resume_is_bitwise(tmp_path: Path) -> None:
    write(tmp_path, 16, 0, 9)
    path = tmp_path / "preference.jsonl"
    straight_model, step, ds = _dpo(path, 0)
    batches = preference_batches(ds, 2)
    straight = [step.run([next(batches)])["loss"] for _ in range(4)]

    model, step, ds = _dpo(path, 0)
    batches = preference_batches(ds, 2)
    first = [step.run([next(batches)])["loss"] for _ in range(2)]
    assert step.reference is not None
    saved = _roundtrip({
        "model": model.state_dict(), "optimizer": step.optimizer.state_dict(),
        "lr": step.lr_scheduler.state_dict(), "reference": step.reference.state_dict(), "data": ds.state_dict(),
    })  # fmt: skip
    model2, step2, ds2 = _dpo(path, 9)  # other weights: everything must come from the state
    model2.load_state_dict(saved["model"])
    step2.optimizer.load_state_dict(saved["optimizer"])
    step2.lr_scheduler.load_state_dict(saved["lr"])
    assert step2.reference is not None
    step2.reference.load_state_dict(saved["reference"])
    ds2.load_state_dict(saved["data"])
    batches2 = preference_batches(ds2, 2)
    resumed = first + [step2.run([next(batches2)])["loss"] for _ in range(2)]
    assert resumed == straight
    for a, b in zip(straight_model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)


def _grpo(seed: int, gen_state: torch.Tensor | None = None) -> tuple[torch.nn.Module, GrpoStep]:
    model = tiny_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    gen = torch.Generator().manual_seed(0)
    settings = GrpoSettings(k=2, max_new_tokens=3)
    step = GrpoStep([model], opt, sched, settings, [exact_match], [1.0], CharTokenizer(), None, None,
                    torch.device("cpu"), gen)  # fmt: skip
    return model, step


def test_grpo_resume_is_bitwise_with_the_generator_state(tmp_path: Path) -> None:
    write(tmp_path, 4, 0, 9)
    prompts = read_prompts(tmp_path / "prompts.jsonl", CharTokenizer(), 64, 3)
    model, step = _grpo(0)
    for i in range(2):
        step.run(prompts[i : i + 1])
    model_b, step_b = _grpo(0)
    step_b.run(prompts[:1])
    saved = _roundtrip({
        "model": model_b.state_dict(), "optimizer": step_b.optimizer.state_dict(),
        "generator": step_b.generator.get_state(),
    })  # fmt: skip
    model_c, step_c = _grpo(5)
    model_c.load_state_dict(saved["model"])
    step_c.optimizer.load_state_dict(saved["optimizer"])
    step_c.generator.set_state(saved["generator"])
    step_c.run(prompts[1:2])
    for a, b in zip(model.parameters(), model_c.parameters(), strict=True):
        assert torch.equal(a, b)
