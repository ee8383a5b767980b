"""GRPO's completions, sampled by our KV-cache generator (``models/common/kv_cache.py``) from
the policy as it is laid out for training (docs/posttrain.md, "Generation").

``k`` completions of one prompt are one batch of ``k`` identical rows: a prefill of the prompt,
then one position per new token. Sampling is softmax at ``temperature`` (optionally top-k) on a
CPU ``torch.Generator`` that the run owns and checkpoints, so a resumed run draws the same tokens.

Under FSDP every FSDP module is unsharded once before the rollout and resharded after: the
whole model's weights are gathered for the rollout (memory: one full copy of the parameters per
rank for its duration; communication: one all-gather of the model per rollout instead of one per
block per decoded token). The forward then issues no collective, so ranks may sample different
prompts. Every rollout decodes exactly ``max_new_tokens`` positions (tokens after a row's EOS are
masked out), so its cost does not depend on what was sampled. Tensor and pipeline parallel are
not supported for generation (refused by :func:`generation_problem`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from torchtitan.models.common.kv_cache import KVCache
from torchtitan.posttrain.logprobs import full_logits


def generation_problem(tp: int, pp: int) -> str | None:
    """Why this layout cannot generate, or None."""
    if tp > 1 or pp > 1:
        return "GRPO's generator runs on data-parallel layouts only (FSDP/DDP/one process): set TP and PP to 1"
    return None


@contextlib.contextmanager
def gathered(model: nn.Module) -> Iterator[None]:
    """Every FSDP module of ``model`` unsharded inside the context (no-op without FSDP)."""
    fsdp = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in fsdp:
        m.unshard()
    try:
        yield
    finally:
        for m in fsdp:
            m.reshard()


def _sample(
    logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator
) -> torch.Tensor:
    logits = logits.float() / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1).cpu()
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1).to(logits.device)


@torch.no_grad()
def sample_completions(
    model: nn.Module,
    prompt: torch.Tensor,
    k: int,
    max_new_tokens: int,
    generator: torch.Generator,
    eos_id: int,
    temperature: float = 1.0,
    top_k: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``k`` completions of ``prompt`` (int ``[P]``): ids ``[k, max_new_tokens]`` and a mask
    ``[k, max_new_tokens]`` that is 1 up to and including each row's first EOS."""
    if temperature <= 0:
        raise ValueError(
            f"GRPO samples at a temperature > 0 (got {temperature}): greedy completions of a prompt are all the same"
        )
    return _decode(
        model, prompt, k, max_new_tokens, eos_id,
        lambda logits: _sample(logits, temperature, top_k, generator),
    )  # fmt: skip


@torch.no_grad()
def greedy_completion(
    model: nn.Module, prompt: torch.Tensor, max_new_tokens: int, eos_id: int
) -> list[int]:
    """The greedy (argmax) completion of ``prompt`` up to and including its first EOS: how a
    policy is evaluated before and after GRPO (docs/posttrain.md, "It learns")."""
    ids, mask = _decode(model, prompt, 1, max_new_tokens, eos_id, lambda lg: lg.argmax(-1))
    return ids[0][mask[0].bool()].tolist()


def _decode(
    model: nn.Module,
    prompt: torch.Tensor,
    k: int,
    max_new_tokens: int,
    eos_id: int,
    pick: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``k`` rows decoded from ``prompt``, ``pick`` choosing each next token from the last
    position's logits ``[k, V]``; ids and the up-to-first-EOS mask, both ``[k, max_new_tokens]``."""
    tokens = prompt.unsqueeze(0).expand(k, -1).contiguous()
    cache = KVCache(prompt.shape[0] + max_new_tokens)
    done = torch.zeros(k, dtype=torch.bool, device=prompt.device)
    mask = torch.zeros(k, max_new_tokens, dtype=torch.long, device=prompt.device)
    new = tokens
    out = []
    with gathered(model):
        for t in range(max_new_tokens):
            positions = torch.arange(
                cache.length, cache.length + new.shape[1], device=prompt.device
            )
            logits = full_logits(model(new, positions=positions, cache=cache))
            nxt = pick(logits[:, -1])
            mask[:, t] = (~done).long()
            nxt = torch.where(done, eos_id, nxt)
            done |= nxt == eos_id
            out.append(nxt)
            new = nxt[:, None]
    return torch.stack(out, dim=1), mask
