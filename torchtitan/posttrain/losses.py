"""The post-training losses (docs/posttrain.md): DPO and its variants on sequence log-probs,
SimPO (reference-free), and GRPO's clipped policy-ratio loss with group-normalised advantages.

Pure tensor functions: the steps (``posttrain/dpo.py``, ``posttrain/grpo.py``) compute the
log-probs and reduce over ranks. The formulas are TRL's (``DPOTrainer``, ``CPOTrainer`` with
``loss_type = "simpo"``, ``GRPOTrainer``); ``tests/unit/test_posttrain_losses.py`` checks each
against TRL itself to 1e-6.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

DpoLossType = Literal["sigmoid", "hinge", "ipo", "robust", "simpo"]
GrpoLossType = Literal["grpo", "bnpo", "dr_grpo"]

REFERENCE_FREE: frozenset[str] = frozenset({"simpo"})
"""DPO loss types that need no reference model."""


@dataclass
class PairScores:
    """Per pair: the loss and the implicit rewards (``beta`` times the log-ratio to the reference,
    or for SimPO ``beta`` times the length-averaged log-prob)."""

    losses: torch.Tensor  # [P]
    chosen_rewards: torch.Tensor  # [P], detached
    rejected_rewards: torch.Tensor  # [P], detached


def dpo_losses(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor | None,
    ref_rejected: torch.Tensor | None,
    *,
    loss_type: DpoLossType = "sigmoid",
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    chosen_tokens: torch.Tensor | None = None,
    rejected_tokens: torch.Tensor | None = None,
    simpo_gamma: float = 0.5,
) -> PairScores:
    """Per-pair DPO losses from summed completion log-probs ``[P]`` of the policy and (not for
    ``simpo``) the reference. ``ipo`` and ``simpo`` average over the completion tokens
    (``chosen_tokens``/``rejected_tokens``, ``[P]``), as TRL does; ``label_smoothing`` is the
    flip probability of ``robust`` (in [0, 0.5)) and SimPO's conservative smoothing."""
    if loss_type == "simpo":
        return _simpo(
            chosen, rejected, chosen_tokens, rejected_tokens, beta, label_smoothing, simpo_gamma
        )
    if ref_chosen is None or ref_rejected is None:
        raise ValueError(f"dpo loss_type {loss_type!r} needs the reference log-probs")
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    delta = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * delta)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * delta)
    elif loss_type == "ipo":
        if chosen_tokens is None or rejected_tokens is None:
            raise ValueError("dpo loss_type 'ipo' needs the completion token counts")
        avg = chosen_ratio / chosen_tokens.clamp(min=1) - rejected_ratio / rejected_tokens.clamp(
            min=1
        )
        losses = (avg - 1 / (2 * beta)) ** 2
    elif loss_type == "robust":
        eps = label_smoothing
        clean = -(1 - eps) * F.logsigmoid(beta * delta)
        flipped = -eps * F.logsigmoid(-beta * delta)
        losses = (clean - flipped) / (1 - 2 * eps)
    else:
        raise ValueError(f"unknown dpo loss_type {loss_type!r}")
    return PairScores(losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach())


def _simpo(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    chosen_tokens: torch.Tensor | None,
    rejected_tokens: torch.Tensor | None,
    beta: float,
    label_smoothing: float,
    gamma: float,
) -> PairScores:
    """SimPO: the length-averaged log-probs' margin minus ``gamma / beta``, no reference."""
    if chosen_tokens is None or rejected_tokens is None:
        raise ValueError("dpo loss_type 'simpo' needs the completion token counts")
    c_avg = chosen / chosen_tokens.clamp(min=1)
    r_avg = rejected / rejected_tokens.clamp(min=1)
    logits = c_avg - r_avg - gamma / beta
    losses = (
        -F.logsigmoid(beta * logits) * (1 - label_smoothing)
        - F.logsigmoid(-beta * logits) * label_smoothing
    )
    return PairScores(losses, beta * c_avg.detach(), beta * r_avg.detach())


def group_advantages(rewards: torch.Tensor, k: int, scale: bool = True) -> torch.Tensor:
    """GRPO's advantages of ``rewards`` ``[G * k]`` (``k`` consecutive completions per prompt):
    the reward minus its group's mean, divided by the group's (unbiased) std + 1e-4 when
    ``scale``. ``k = 1`` is refused: every advantage would be zero."""
    if k < 2:
        raise ValueError(
            f"GRPO needs k >= 2 completions per prompt (got {k}): with one, every advantage is 0"
        )
    grouped = rewards.view(-1, k)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale:
        centred = centred / (grouped.std(dim=1, keepdim=True) + 1e-4)
    return centred.reshape(-1)


@dataclass
class GrpoLoss:
    """The loss and its per-token terms (for the metrics)."""

    loss: torch.Tensor
    ratio: torch.Tensor  # [B, T] policy / old policy
    kl: torch.Tensor | None  # [B, T] k3 estimate of KL(policy || reference), or None (beta 0)


def grpo_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    ref_logps: torch.Tensor | None = None,
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    loss_type: GrpoLossType = "grpo",
    max_completion_length: int | None = None,
    count: torch.Tensor | None = None,
) -> GrpoLoss:
    """The clipped policy-ratio loss over completion tokens ``[B, T]`` (``mask`` 1 on completion
    tokens), with advantages ``[B]``, plus ``beta`` times the k3 KL to ``ref_logps``. Averaging:
    ``grpo`` each sequence's token mean, then the mean over sequences (sequence level);
    ``bnpo`` the mean over all completion tokens (token level); ``dr_grpo`` the token sum over
    ``B * max_completion_length``. ``count`` replaces the local count these divide by
    (sequences for ``grpo``/``dr_grpo``, tokens for ``bnpo``): the global batch's count over the
    data-parallel degree, so that averaged gradients are the global batch's."""
    mask = mask.to(logps.dtype)
    adv = advantages.unsqueeze(1)
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    per_token = -torch.min(ratio * adv, clipped * adv)
    kl = None
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("grpo beta != 0 needs the reference log-probs")
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        per_token = per_token + beta * kl
    if loss_type == "grpo":
        seq = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        loss = seq.mean() if count is None else seq.sum() / count
    elif loss_type == "bnpo":
        n = mask.sum().clamp(min=1.0) if count is None else count
        loss = (per_token * mask).sum() / n
    elif loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("grpo loss_type 'dr_grpo' needs max_completion_length")
        rows = per_token.size(0) if count is None else count
        loss = (per_token * mask).sum() / (rows * max_completion_length)
    else:
        raise ValueError(f"unknown grpo loss_type {loss_type!r}")
    return GrpoLoss(loss, ratio, kl)


def clip_fraction(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
) -> torch.Tensor:
    """Fraction of completion tokens whose ratio the clip holds (TRL's ``clip_ratio/region_mean``)."""
    adv = advantages.unsqueeze(1)
    clipped = ((ratio < 1 - eps_low) & (adv < 0)) | ((ratio > 1 + eps_high) & (adv > 0))
    m = mask.to(ratio.dtype)
    return (clipped.to(ratio.dtype) * m).sum() / m.sum().clamp(min=1.0)
