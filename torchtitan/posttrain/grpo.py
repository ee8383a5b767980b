"""One GRPO optimizer step (docs/posttrain.md, "GRPO"): sample ``k`` completions of each of this
rank's prompts (``rollout.py``), score them (``rewards.py``), normalise the rewards within each
prompt's group, and take one clipped policy-ratio step on the completion tokens (``losses.py``),
optionally with the KL to the reference.

One optimizer step per rollout, as TRL's default (``num_iterations = 1``): the "old" policy is
the current one, so the ratio is 1 in value and the clip fraction 0; the gradient is the
advantage-weighted log-likelihood gradient. A group whose reward function raised or returned a
non-finite value is skipped (no gradient, not in the averages) and counted in ``skipped_groups``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.data.chat_template import ChatTokenizer, tokenize_conversation
from torchtitan.distributed import utils as dist_utils
from torchtitan.loss.cross_entropy import IGNORE_INDEX
from torchtitan.posttrain.logprobs import token_entropy, token_logprobs
from torchtitan.posttrain.losses import GrpoLossType, clip_fraction, group_advantages, grpo_loss
from torchtitan.posttrain.reference import Reference
from torchtitan.posttrain.rewards import RewardFn, score
from torchtitan.posttrain.rollout import greedy_completion, sample_completions

Prompt = tuple[torch.Tensor, "str | None"]  # prompt ids [P], answer
METRICS = (
    "reward_mean",
    "reward_std",
    "kl",
    "completion_length",
    "clip_fraction",
    "entropy",
    "skipped_groups",
)


@dataclass
class GrpoSettings:
    k: int = 4
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_k: int = 0
    beta: float = 0.0
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    loss_type: GrpoLossType = "grpo"
    scale_rewards: bool = True


def read_prompts(
    path: str | Path, tokenizer: ChatTokenizer, seq_len: int, max_new_tokens: int
) -> list[Prompt]:
    """Prompt records ``{"prompt": str | messages, "answer": str}`` of a JSONL file, rendered
    with the chat template up to the assistant's turn; ``ValueError`` naming the line of a
    prompt that leaves no room for ``max_new_tokens`` in ``seq_len``."""
    out: list[Prompt] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            rec: dict[str, Any] = json.loads(line)
            p = rec["prompt"]
            msgs = [{"role": "user", "content": p}] if isinstance(p, str) else list(p)
            ids, train = tokenize_conversation(
                tokenizer, [*msgs, {"role": "assistant", "content": ""}], None
            )
            ids = ids[: train.index(True)]  # up to the (empty) assistant content
            if len(ids) + max_new_tokens > seq_len:
                raise ValueError(
                    f"{path}:{lineno}: prompt of {len(ids)} tokens + grpo.max_new_tokens = "
                    f"{max_new_tokens} exceeds training.seq_len = {seq_len}; shorten it or raise seq_len"
                )
            answer = rec.get("answer")
            out.append(
                (torch.tensor(ids, dtype=torch.long), None if answer is None else str(answer))
            )
    return out


def greedy_reward(
    model: nn.Module,
    prompts: Sequence[Prompt],
    tokenizer: Any,
    reward: RewardFn,
    max_new_tokens: int,
    device: torch.device,
) -> float:
    """The mean ``reward`` of the policy's greedy completions of ``prompts``: a deterministic
    measure of what GRPO changed (the per-step reward mean is a noisy sample)."""
    total = 0.0
    for prompt, answer in prompts:
        ids = greedy_completion(model, prompt.to(device), max_new_tokens, tokenizer.eos_id)
        total += reward(tokenizer.decode([t for t in ids if t != tokenizer.eos_id]), answer)
    return total / max(len(prompts), 1)


@dataclass
class GrpoStep:
    parts: list[nn.Module]
    optimizer: torch.optim.Optimizer
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler
    settings: GrpoSettings
    rewards: Sequence[RewardFn]
    reward_weights: Sequence[float]
    tokenizer: Any
    reference: Reference | None
    dp_mesh: DeviceMesh | None
    device: torch.device
    generator: torch.Generator
    max_norm: float = 1.0
    skipped_reasons: list[str] = field(default_factory=list)
    # (global loss, grad norm) -> whether the optimizer steps (the trainer's non-finite guard).
    before_update: Callable[[torch.Tensor, torch.Tensor], bool] | None = None
    last_loss: torch.Tensor | None = None

    def __post_init__(self) -> None:
        group_advantages(torch.zeros(max(self.settings.k, 1)), self.settings.k)  # refuses k = 1
        s = self.settings
        if s.beta != 0 and self.reference is None:
            raise ValueError("grpo.beta != 0 needs a reference")
        if (
            s.beta < 0
            or s.temperature <= 0
            or s.max_new_tokens < 1
            or min(s.epsilon_low, s.epsilon_high) < 0
        ):
            raise ValueError(
                f"grpo settings out of range: beta {s.beta} (>= 0), temperature {s.temperature} (> 0), "
                f"max_new_tokens {s.max_new_tokens} (>= 1), epsilon_low/high {s.epsilon_low}/{s.epsilon_high} (>= 0)"
            )
        if len(self.rewards) != len(self.reward_weights) or not self.rewards:
            raise ValueError(
                f"{len(self.rewards)} reward functions but {len(self.reward_weights)} weights"
            )

    def _sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.dp_mesh is not None and self.dp_mesh.size() > 1:
            dist_utils.all_reduce_(t, self.dp_mesh, op="sum")
        return t

    def rollout(
        self, prompts: Sequence[Prompt]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """inputs, labels (completion tokens of scored groups only), advantages, rewards (NaN
        for skipped groups), skipped groups."""
        s, model = self.settings, self.parts[0]
        rows, labels, advs, rewards, skipped = [], [], [], [], 0
        width = max(len(p) for p, _ in prompts) + s.max_new_tokens
        for prompt, answer in prompts:
            prompt = prompt.to(self.device)
            ids, mask = sample_completions(
                model,
                prompt,
                s.k,
                s.max_new_tokens,
                self.generator,
                self.tokenizer.eos_id,
                s.temperature,
                s.top_k,
            )
            texts = [
                self.tokenizer.decode(
                    [t for t in r[m.bool()].tolist() if t != self.tokenizer.eos_id]
                )
                for r, m in zip(ids, mask, strict=True)
            ]
            values, reason = score(self.rewards, self.reward_weights, texts, answer)
            if reason is not None:
                skipped += 1
                self.skipped_reasons.append(reason)
                mask = torch.zeros_like(mask)
                values = [float("nan")] * s.k
                adv = torch.zeros(s.k)
            else:
                adv = group_advantages(torch.tensor(values), s.k, s.scale_rewards)
            for r, m in zip(ids, mask, strict=True):
                row = torch.full(
                    (width,), self.tokenizer.eos_id, dtype=torch.long, device=self.device
                )
                row[: len(prompt)] = prompt
                row[len(prompt) : len(prompt) + len(r)] = r
                lab = torch.full((width,), IGNORE_INDEX, dtype=torch.long, device=self.device)
                lab[len(prompt) : len(prompt) + len(r)] = torch.where(m.bool(), r, IGNORE_INDEX)
                rows.append(row)
                labels.append(lab)
            advs.append(adv)
            rewards += values
        x, y = torch.stack(rows), torch.stack(labels)
        return x[:, :-1], y[:, 1:], torch.cat(advs).to(self.device), torch.tensor(rewards), skipped

    def run(self, prompts: Sequence[Prompt]) -> dict[str, float]:
        s = self.settings
        inputs, labels, adv, rewards, skipped = self.rollout(prompts)
        mask = (labels != IGNORE_INDEX).float()
        self.optimizer.zero_grad(set_to_none=True)
        ref = None
        if s.beta != 0:
            assert self.reference is not None
            with torch.no_grad(), self.reference.active():
                ref = token_logprobs(self.parts[0](inputs), labels)
        logits = self.parts[0](inputs)
        logps = token_logprobs(logits, labels)
        entropy = token_entropy(logits)
        del logits
        valid = (mask.sum(-1) > 0).float()
        dp = self.dp_mesh.size() if self.dp_mesh is not None else 1
        counts = self._sum(torch.stack([valid.sum(), mask.sum()]))
        count = (counts[1] if s.loss_type == "bnpo" else counts[0]).clamp(min=1.0) / dp
        out = grpo_loss(
            logps, logps.detach(), adv, mask, ref_logps=ref, beta=s.beta, epsilon_low=s.epsilon_low,
            epsilon_high=s.epsilon_high, loss_type=s.loss_type, max_completion_length=s.max_new_tokens, count=count,
        )  # fmt: skip
        out.loss.backward()
        params = [p for part in self.parts for p in part.parameters() if p.requires_grad]
        norm = dist_utils.clip_grad_norm_(params, self.max_norm)
        self.last_loss = self._sum(out.loss.detach().clone()) / dp  # the global batch's loss
        if self.before_update is None or self.before_update(self.last_loss, norm):
            self.optimizer.step()
        self.lr_scheduler.step()
        return self._metrics(out, adv, mask, entropy, rewards, skipped, float(norm))

    def _metrics(self, out: Any, adv: torch.Tensor, mask: torch.Tensor, entropy: torch.Tensor,
                 rewards: torch.Tensor, skipped: int, norm: float) -> dict[str, float]:  # fmt: skip
        s = self.settings
        ok = ~torch.isnan(rewards)
        r = rewards[ok].to(self.device)
        kl = (
            (out.kl.detach() * mask).sum()
            if out.kl is not None
            else torch.zeros((), device=self.device)
        )
        clip = (
            clip_fraction(out.ratio.detach(), adv, mask, s.epsilon_low, s.epsilon_high) * mask.sum()
        )
        sums = torch.stack([
            r.sum(), (r * r).sum(), ok.sum().to(self.device).float(), kl, mask.sum(),
            clip, (entropy * mask).sum(), torch.tensor(float(skipped), device=self.device),
        ])  # fmt: skip
        t = self._sum(sums).tolist()
        n, tokens = max(t[2], 1.0), max(t[4], 1.0)
        mean = t[0] / n
        var = max(t[1] / n - mean * mean, 0.0)
        values = [mean, var**0.5, t[3] / tokens, t[4] / n, t[5] / tokens, t[6] / tokens, t[7]]
        return dict(zip(METRICS, values, strict=True)) | {"grad_norm": norm}
