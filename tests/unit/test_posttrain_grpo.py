"""GRPO's pieces on a tiny Llama in one process (docs/posttrain.md): the reward registry (built-in,
an import path, a bad name), a reward that raises or returns NaN skips its group and is counted
(the step still runs), k = 1 and greedy sampling are refused with the reason, a prompt longer than
seq_len is refused naming its line, the KV-cache sampler is reproducible from its generator state
and equals sampling without the cache, and a step changes the policy."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.posttrain_helpers import CharTokenizer, tiny_model
from torchtitan.posttrain.grpo import GrpoSettings, GrpoStep, greedy_reward, read_prompts
from torchtitan.posttrain.reference import Reference
from torchtitan.posttrain.rewards import exact_match, format_check, resolve
from torchtitan.posttrain.rollout import greedy_completion, sample_completions


def nan_reward(completion: str, answer: str | None) -> float:
    return math.nan


def raising_reward(completion: str, answer: str | None) -> float:
    raise RuntimeError("grader offline")


def _model(seed: int = 0) -> torch.nn.Module:
    return tiny_model(seed)


def _prompts(tmp_path: Path, n: int = 2) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(n))
    )
    return path


def _step(model: torch.nn.Module, rewards: list, k: int = 3, beta: float = 0.0) -> GrpoStep:
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    return GrpoStep(
        [model], opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0),
        GrpoSettings(k=k, max_new_tokens=4, beta=beta), rewards, [1.0] * len(rewards), CharTokenizer(),
        Reference([model]) if beta else None, None, torch.device("cpu"), torch.Generator().manual_seed(0),
    )  # fmt: skip


def test_reward_registry() -> None:
    assert exact_match("The sum is 12.", "12") == 1.0 and exact_match("13", "12") == 0.0
    assert format_check(" 12 ", None) == 1.0
    assert format_check("twelve", None) == 0.0
    assert resolve("exact_match") is exact_match
    assert resolve("tests.unit.test_posttrain_grpo:nan_reward") is nan_reward
    with pytest.raises(ValueError, match="neither built in"):
        resolve("no_such_reward")
    with pytest.raises(ValueError, match="cannot be imported"):
        resolve("tests.unit.nowhere:fn")


def test_failing_rewards_skip_their_group_and_count(tmp_path: Path) -> None:
    prompts = read_prompts(_prompts(tmp_path), CharTokenizer(), 64, 4)
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    step = _step(model, [raising_reward])
    m = step.run(prompts)
    assert m["skipped_groups"] == 2 and "grader offline" in step.skipped_reasons[0]
    assert all(
        torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)
    )  # no gradient
    m = _step(model, [nan_reward]).run(prompts)
    assert m["skipped_groups"] == 2


def test_step_trains_and_reports(tmp_path: Path) -> None:
    prompts = read_prompts(_prompts(tmp_path, 2), CharTokenizer(), 64, 4)
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    m = _step(model, [lambda c, a: float(sum(map(ord, c)) % 7)], beta=0.04).run(prompts)
    assert set(m) >= {
        "reward_mean",
        "reward_std",
        "kl",
        "completion_length",
        "clip_fraction",
        "entropy",
    }
    assert m["skipped_groups"] == 0 and m["entropy"] > 0 and 0 < m["completion_length"] <= 4
    assert m["kl"] == pytest.approx(0.0, abs=1e-7)  # the policy was the reference at this step
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_bad_settings_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"k >= 2 .*every advantage is 0"):
        _step(_model(), [exact_match], k=1)
    with pytest.raises(ValueError, match="temperature > 0"):
        sample_completions(
            _model(), torch.tensor([5, 6]), 2, 3, torch.Generator(), 0, temperature=0.0
        )
    with pytest.raises(ValueError, match=r"prompts.jsonl:1: prompt of \d+ tokens"):
        read_prompts(_prompts(tmp_path), CharTokenizer(), 12, 8)


def test_sampler_reproducible_and_equals_no_cache() -> None:
    model, prompt = _model(), torch.tensor([5, 6, 7, 8])
    g = torch.Generator().manual_seed(3)
    state = g.get_state()
    ids, mask = sample_completions(model, prompt, 3, 5, g, eos_id=0)
    g2 = torch.Generator()
    g2.set_state(state)  # a resumed run restores the generator's state
    again, _ = sample_completions(model, prompt, 3, 5, g2, eos_id=0)
    assert torch.equal(ids, again) and mask.shape == (3, 5)
    # the cache changes nothing: recompute the whole prefix for each position with the same draws
    g3 = torch.Generator()
    g3.set_state(state)
    tokens = prompt.expand(3, -1)
    with torch.no_grad():
        for _ in range(5):
            probs = torch.softmax(model(tokens)[:, -1].float(), -1)
            nxt = torch.multinomial(probs, 1, generator=g3)
            tokens = torch.cat([tokens, nxt], 1)
    assert torch.equal(tokens[:, 4:], ids)


def test_greedy_completion_is_the_argmax_path_and_stops_at_eos() -> None:
    model, prompt = _model(), torch.tensor([5, 6, 7, 8])
    tokens = prompt[None]
    with torch.no_grad():
        for _ in range(5):
            tokens = torch.cat([tokens, model(tokens)[:, -1].argmax(-1, keepdim=True)], 1)
    path = tokens[0, 4:].tolist()
    assert greedy_completion(model, prompt, 5, eos_id=999) == path  # no EOS: all 5 tokens
    # with the second token as EOS the completion ends there, EOS included
    assert greedy_completion(model, prompt, 5, eos_id=path[1]) == path[: path.index(path[1]) + 1]
    tok = CharTokenizer()  # decoding drops EOS (0) wherever the path has it
    prompts = [(prompt, tok.decode(path)), (prompt, tok.decode(path) + "x")]
    same = lambda text, answer: float(text == answer)  # noqa: E731
    assert greedy_reward(model, prompts, tok, same, 5, torch.device("cpu")) == 0.5
