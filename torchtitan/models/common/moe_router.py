"""The router and the arguments of the shared Mixture-of-Experts layer (docs/moe.md).

:class:`Router`: token -> (expert ids, weights, scores): softmax or sigmoid scores, optional
group-limited top-k, score normalisation; an optional per-expert bias steers the *selection*
only (auxiliary-loss-free balancing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.common.moe_experts import local_weight

__all__ = ["MoEArgs", "Router"]


@dataclass(frozen=True)
class MoEArgs:
    """Shape and routing of one Mixture-of-Experts layer."""

    num_experts: int = 8
    top_k: int = 2
    expert_dim: int = 128
    """Hidden width of each routed SwiGLU expert (``moe_intermediate_size``)."""
    num_shared_experts: int = 0
    """Experts every token runs, un-gated, fused into one SwiGLU of ``num * expert_dim``."""
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    route_norm: bool = True
    """Rescale a token's top-k weights to sum to 1 (Qwen3-MoE's ``norm_topk_prob``)."""
    route_scale: float = 1.0
    n_groups: int = 1
    """Group-limited routing: experts split into ``n_groups`` groups, a token may use only the
    ``topk_groups`` best groups (group score: the sum of its two best scores). 1: off."""
    topk_groups: int = 1
    aux_loss_coef: float = 0.0
    bias_update_rate: float = 0.0
    """Auxiliary-loss-free balancing step size; 0 disables the bias."""

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in 1..num_experts={self.num_experts}")
        if self.num_experts % self.n_groups != 0:
            raise ValueError(f"num_experts={self.num_experts} not divisible by n_groups")
        if self.n_groups > 1 and not (
            1 <= self.topk_groups <= self.n_groups
            and self.top_k <= self.topk_groups * self.num_experts // self.n_groups
        ):
            raise ValueError(f"topk_groups={self.topk_groups} cannot hold top_k={self.top_k}")

    def num_params(self, dim: int, active: bool = False) -> int:
        """Router + routed experts (all, or the ``top_k`` a token uses) + shared experts."""
        routed = self.top_k if active else self.num_experts
        swiglu = 3 * dim * self.expert_dim
        return self.num_experts * dim + (routed + self.num_shared_experts) * swiglu


class Router(nn.Module):
    """Token -> (expert ids ``[T, k]``, weights ``[T, k]``, scores ``[T, E]``)."""

    param_kind = "router"  # its parameters' optimizer kind (docs/optimizers.md)
    expert_bias: torch.Tensor

    def __init__(self, dim: int, args: MoEArgs) -> None:
        super().__init__()
        self.args = args
        self.gate = nn.Linear(dim, args.num_experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(args.num_experts), persistent=True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a = self.args
        logits = F.linear(x, local_weight(self.gate.weight)).float()
        scores = logits.softmax(-1) if a.score_func == "softmax" else logits.sigmoid()
        choose = scores.detach() + self.expert_bias if a.bias_update_rate > 0 else scores.detach()
        if a.n_groups > 1:
            choose = _limit_groups(choose, a.n_groups, a.topk_groups)
        idx = choose.topk(a.top_k, dim=-1).indices
        weights = scores.gather(-1, idx)
        if a.route_norm:
            weights = weights / (
                weights.sum(-1, keepdim=True) + (a.score_func == "sigmoid") * 1e-20
            )
        return idx, weights * a.route_scale, scores


def _limit_groups(scores: torch.Tensor, n_groups: int, topk_groups: int) -> torch.Tensor:
    """``scores`` with every expert outside a token's ``topk_groups`` best groups set to -inf."""
    t, e = scores.shape
    grouped = scores.view(t, n_groups, e // n_groups)
    group_score = grouped.topk(min(2, e // n_groups), dim=-1).values.sum(-1)  # [T, G]
    keep = torch.zeros_like(group_score, dtype=torch.bool)
    keep.scatter_(1, group_score.topk(topk_groups, dim=-1).indices, True)
    return grouped.masked_fill(~keep[..., None], float("-inf")).view(t, e)
