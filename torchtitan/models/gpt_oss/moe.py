"""GPT-OSS's Mixture-of-Experts layer: the shared one (``models/common/moe.py``: dropless sorted
dispatch, grouped GEMM, expert parallel, auxiliary loss, load metrics) with GPT-OSS's router and
experts (docs/gpt_oss.md):

* the router is a biased linear; a token takes the ``top_k`` largest logits and weighs its
  experts by the softmax over those ``top_k`` logits only;
* each expert is ``down(clamped_swiglu(gate_up(x) + b_gu)) + b_down``, with ``gate_up`` one
  fused ``[dim, 2 * hidden]`` matrix whose even columns are the gate and odd columns the up
  projection (Hugging Face's layout, so the checkpoint maps by name alone).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.common.moe import MoE, MoEArgs
from torchtitan.models.common.moe_experts import StackedExperts, local_weight
from torchtitan.models.common.moe_router import Router

__all__ = ["GptOssExperts", "GptOssMoE", "GptOssRouter", "clamped_swiglu"]


def clamped_swiglu(gate_up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``;
    gate and up interleaved on the last dimension (gate first)."""
    gate = gate_up[..., 0::2].clamp(max=limit)
    up = gate_up[..., 1::2].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(alpha * gate))


class GptOssRouter(Router):
    """Token -> (expert ids ``[T, k]``, softmax over the top-k logits ``[T, k]``, softmax over
    all logits ``[T, E]``, which the auxiliary loss reads)."""

    def __init__(self, dim: int, args: MoEArgs) -> None:
        super().__init__(dim, args)
        self.gate = nn.Linear(dim, args.num_experts, bias=True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a = self.args
        bias = self.gate.bias
        logits = F.linear(x, local_weight(self.gate.weight), local_weight(bias)).float()
        choose = logits.detach()
        if a.bias_update_rate > 0:  # auxiliary-loss-free balancing steers the selection only
            choose = choose + self.expert_bias
        idx = choose.topk(a.top_k, dim=-1).indices
        weights = logits.gather(-1, idx).softmax(dim=-1)
        return idx, weights * a.route_scale, logits.softmax(dim=-1)


class GptOssExperts(StackedExperts):
    """``E`` biased clamped-SwiGLU experts as stacked weights: ``gate_up_proj [E, dim, 2H]``,
    ``gate_up_proj_bias [E, 2H]``, ``down_proj [E, H, dim]``, ``down_proj_bias [E, dim]``. The
    two matrices go through :meth:`project` (the shared experts' hook: LoRA's per-expert adapters
    take both, docs/lora.md); the biases are added after it."""

    projections = ("gate_up_proj", "down_proj")

    def __init__(self, num_experts: int, dim: int, hidden: int, limit: float, alpha: float):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, dim, 2 * hidden))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, dim))
        self.limit, self.alpha = limit, alpha
        self.use_grouped_mm = None
        self.grad_scale = 1.0

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows of ``x`` sorted by expert, ``counts[e]`` of them for (local) expert ``e``."""
        b_gu, b_down = (
            local_weight(getattr(self, n), self.grad_scale)
            for n in ("gate_up_proj_bias", "down_proj_bias")
        )
        grouped = self._grouped(x)
        local = torch.arange(counts.numel(), device=x.device)
        expert = torch.repeat_interleave(local, counts, output_size=x.shape[0])
        h = self.project(x, "gate_up_proj", counts, grouped) + b_gu[expert]
        h = clamped_swiglu(h, self.limit, self.alpha)
        return self.project(h, "down_proj", counts, grouped) + b_down[expert]


class GptOssMoE(MoE):
    """The shared MoE layer with :class:`GptOssRouter` and :class:`GptOssExperts`."""

    def __init__(self, dim: int, args: MoEArgs, limit: float, alpha: float) -> None:
        if args.num_shared_experts:
            raise ValueError("GPT-OSS has no shared experts")
        super().__init__(dim, args)
        self.router = GptOssRouter(dim, args)
        self.experts = GptOssExperts(  # type: ignore[assignment]
            args.num_experts, dim, args.expert_dim, limit, alpha
        )
