"""Mixture-of-Experts feed-forward shared by model families (docs/moe.md).

One :class:`MoE` layer = a :class:`Router` (scores, optional group-limited top-k, score
normalisation), routed SwiGLU experts held as stacked ``[E, ...]`` weights (:class:`Experts`) and
optional shared experts every token runs. Dispatch is dropless: every token reaches its ``top_k``
experts, whatever the load; tokens are sorted by expert and the experts run as one grouped GEMM
(``torch._grouped_mm``) where the device and dtype support it (probed once), an exact per-expert
loop elsewhere.

Load balancing, both optional and combinable:

* the auxiliary loss (``aux_loss_coef``): sequence-wise ``E * sum_e f_e * P_e`` (``f_e`` the share
  of a sequence's routed slots taken by expert ``e``, ``P_e`` its mean routing probability),
  averaged over sequences. Per-sequence, so a data-parallel split of the batch gives the same
  mean as one process. It enters the backward where it is computed: the layer's output carries
  it (:class:`_AttachAuxLoss`: identity forward, the backward also seeds ``d aux = scale``), so
  it trains every pipeline stage's routers without travelling to the last stage. ``scale`` is
  the one the cross-entropy gets (``1 / (grad_accum x microbatches)``), set by the trainer with
  :func:`set_aux_loss_scale`. Its detached value is summed on the device for the metrics;
* the auxiliary-loss-free bias (``bias_update_rate``): a per-expert bias added to the scores for
  the *selection* only; after each optimizer step :func:`update_expert_bias` moves it by
  ``rate * sign(mean load - load)`` (under-loaded experts become more likely).

``tokens_per_expert`` accumulates each expert's load on the device between updates (no host
synchronisation per step).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from torchtitan.distributed.expert_parallel import run_experts, scale_grad

__all__ = [
    "MoE",
    "MoEArgs",
    "collect_aux_loss",
    "grouped_mm_supported",
    "moe_overrides",
    "set_aux_loss_scale",
    "update_expert_bias",
]


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

    expert_bias: torch.Tensor

    def __init__(self, dim: int, args: MoEArgs) -> None:
        super().__init__()
        self.args = args
        self.gate = nn.Linear(dim, args.num_experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(args.num_experts), persistent=True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a = self.args
        logits = F.linear(x, _local(self.gate.weight, 1.0)).float()
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


@functools.cache
def grouped_mm_supported(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs forward and backward here and matches a loop (probed
    once per device type and dtype: support differs across torch versions and devices)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(24, 16, generator=gen).to(device_type, dtype).requires_grad_()
        w = torch.randn(3, 16, 16, generator=gen).to(device_type, dtype).requires_grad_()
        offs = torch.tensor([8, 8, 24], dtype=torch.int32, device=device_type)
        y = torch._grouped_mm(x, w, offs=offs)
        y.backward(torch.ones_like(y))
        ref = torch.cat([x[:8] @ w[0], x[8:] @ w[2]])
        return bool(torch.allclose(y, ref, rtol=1e-2, atol=1e-2)) and w.grad is not None
    except (RuntimeError, NotImplementedError):
        return False


def expert_matmul(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, grouped: bool):
    """Rows of ``x`` (sorted by expert, ``counts[e]`` rows for expert ``e``) times ``w[e]``."""
    if grouped:
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        return torch._grouped_mm(x, w, offs=offs)
    parts = torch.split(x, counts.tolist())  # the fallback: one host sync per call
    return torch.cat([p @ w[e] for e, p in enumerate(parts)])


class Experts(nn.Module):
    """``E`` SwiGLU experts as stacked weights: ``w1``/``w3`` ``[E, dim, hidden]``, ``w2``
    ``[E, hidden, dim]`` (a token's row times the matrix, no transpose)."""

    def __init__(self, num_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.use_grouped_mm: bool | None = None
        """None: decided by :func:`grouped_mm_supported`; True/False forces a path."""
        self.grad_scale = 1.0
        """Gradient factor of expert-parallel (DTensor) weights: 1 / ep."""

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # Under expert parallel the weights are DTensors: this rank's experts are its shard,
        # and their gradients are scaled by 1 / ep (distributed/expert_parallel.py).
        w1, w2, w3 = (_local(w, self.grad_scale) for w in (self.w1, self.w2, self.w3))
        grouped = self.use_grouped_mm
        if grouped is None:
            grouped = grouped_mm_supported(x.device.type, x.dtype) and _aligned(x, w1, w2)
        h = F.silu(expert_matmul(x, w1, counts, grouped)) * expert_matmul(x, w3, counts, grouped)
        return expert_matmul(h, w2, counts, grouped)


def _local(w: torch.Tensor, grad_scale: float) -> torch.Tensor:
    """A weight's local values: expert-parallel shards (gradient scaled by ``grad_scale``) and
    tensor-parallel replicas (``distributed/replicate_parallel.py``) compute locally."""
    if not isinstance(w, DTensor):
        return w
    local = w.to_local()
    return local if grad_scale == 1.0 else scale_grad(local, grad_scale)


def _aligned(x: torch.Tensor, *ws: torch.Tensor) -> bool:
    """grouped_mm needs every row stride to be a multiple of 16 bytes."""
    return all((t.shape[-1] * t.element_size()) % 16 == 0 for t in (x, *ws))


class SharedExpert(nn.Module):
    """The shared experts: one dense SwiGLU every token runs."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (_local(m.weight, 1.0) for m in (self.w1, self.w2, self.w3))
        return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


class MoE(nn.Module):
    """``[B, S, dim] -> [B, S, dim]``: routed experts (+ shared experts), dropless."""

    tokens_per_expert: torch.Tensor
    load_since_log: torch.Tensor
    aux_since_log: torch.Tensor

    def __init__(self, dim: int, args: MoEArgs) -> None:
        super().__init__()
        self.args = args
        self.router = Router(dim, args)
        self.experts = Experts(args.num_experts, dim, args.expert_dim)
        self.shared: SharedExpert | None = None
        if args.num_shared_experts > 0:
            self.shared = SharedExpert(dim, args.num_shared_experts * args.expert_dim)
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts), persistent=False)
        # Since the last log step, for the metrics (moe_metrics.py): load and aux-loss sum.
        self.register_buffer("load_since_log", torch.zeros(args.num_experts), persistent=False)
        self.register_buffer("aux_since_log", torch.zeros(2), persistent=False)  # sum, count
        self.aux_loss_scale = 1.0
        """Gradient seed of the auxiliary loss (:func:`set_aux_loss_scale`)."""
        self.aux_loss: torch.Tensor | None = None
        """The last forward's auxiliary loss (detached), None when the coefficient is 0."""
        self.ep_mesh: DeviceMesh | None = None
        """Set by expert parallel (:meth:`enable_expert_parallel`)."""

    def enable_expert_parallel(self, mesh: DeviceMesh) -> list[nn.Parameter]:
        """Shard the routed experts on dimension 0 over ``mesh`` (``distributed/
        expert_parallel.py``); returns the sharded parameters."""
        if self.args.num_experts % mesh.size() != 0:
            raise ValueError(f"{self.args.num_experts} experts cannot split over {mesh.size()}")
        for name in ("w1", "w2", "w3"):
            weight = getattr(self.experts, name)
            sharded = nn.Parameter(distribute_tensor(weight.data, mesh, [Shard(0)]))
            setattr(self.experts, name, sharded)
        self.ep_mesh = mesh
        self.experts.grad_scale = 1.0 / mesh.size()
        return [self.experts.w1, self.experts.w2, self.experts.w3]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, seqlen, dim = x.shape
        flat = x.reshape(-1, dim)
        idx, weights, scores = self.router(flat)
        counts = torch.bincount(idx.flatten(), minlength=self.args.num_experts)
        if self.training:
            with torch.no_grad():
                self.tokens_per_expert += counts.to(self.tokens_per_expert.dtype)
                self.load_since_log += counts.to(self.load_since_log.dtype)
        routed = self.dispatch_and_combine(flat, idx, weights.to(x.dtype), counts)
        if self.shared is not None:
            routed = routed + self.shared(flat)
        self.aux_loss = None
        if self.args.aux_loss_coef > 0:
            aux = self._aux_loss(idx, scores, bs)
            self.aux_loss = aux.detach()
            if self.training:
                self.aux_since_log += torch.stack([self.aux_loss, torch.ones_like(self.aux_loss)])
            if torch.is_grad_enabled():
                routed = _AttachAuxLoss.apply(routed, aux, self.aux_loss_scale)
        return routed.view(bs, seqlen, dim)

    def dispatch_and_combine(
        self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        """Sort the ``T * k`` (token, expert) slots by expert, run the experts, weight each
        slot and sum every token's slots back in expert order."""
        k = idx.shape[1]
        order = idx.flatten().argsort(stable=True)
        token = order // k
        if self.ep_mesh is None:
            out = self.experts(x[token], counts)
        else:
            out = run_experts(x[token], counts, self.experts, self.ep_mesh)
        out = out * weights.flatten()[order, None]
        return torch.zeros_like(x).index_add_(0, token, out)

    def _aux_loss(self, idx: torch.Tensor, scores: torch.Tensor, bs: int) -> torch.Tensor:
        e = self.args.num_experts
        seq = scores.view(bs, -1, e)
        probs = seq / seq.sum(-1, keepdim=True) if self.args.score_func == "sigmoid" else seq
        load = F.one_hot(idx.view(bs, -1), e).float().mean(1)  # [B, E]: share of slots
        balance = e * (load * probs.mean(1)).sum(-1)  # [B], 1.0 when perfectly balanced
        return self.args.aux_loss_coef * balance.mean()

    @torch.no_grad()
    def update_bias(self, counts: torch.Tensor) -> None:
        """One auxiliary-loss-free step: ``bias += rate * sign(mean(counts) - counts)``."""
        rate = self.args.bias_update_rate
        bias = self.router.expert_bias
        bias += rate * torch.sign(counts.mean() - counts).to(bias.dtype)


class _AttachAuxLoss(torch.autograd.Function):
    """``out`` unchanged; in the backward, ``aux`` receives the gradient ``scale`` as if
    ``scale * aux`` had been added to the loss."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # type: ignore[override]
        shape, dtype, device = ctx.aux_meta
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


def moe_overrides(args: Any, model_cfg: Any) -> Any:
    """``args`` with ``model.moe_aux_loss_coef`` / ``model.moe_bias_update_rate`` applied to its
    ``moe`` field where they are set (>= 0); preflight refuses them for a model without one."""
    moe = getattr(args, "moe", None)
    changes = {
        "aux_loss_coef": model_cfg.moe_aux_loss_coef,
        "bias_update_rate": model_cfg.moe_bias_update_rate,
    }
    changes = {k: v for k, v in changes.items() if v >= 0}
    if moe is None or not changes:
        return args
    return dataclasses.replace(args, moe=dataclasses.replace(moe, **changes))


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def collect_aux_loss(model: nn.Module) -> torch.Tensor | None:
    """The sum of the MoE layers' auxiliary losses of the last forward (detached), or None."""
    losses = [m.aux_loss for m in moe_layers(model) if m.aux_loss is not None]
    return torch.stack(losses).sum() if losses else None


def set_aux_loss_scale(models: list[nn.Module], scale: float) -> None:
    """The gradient seed of every MoE layer's auxiliary loss: the factor the training loss of
    one forward gets (``1 / (grad_accum_steps x pipeline microbatches)``)."""
    for model in models:
        for layer in moe_layers(model):
            layer.aux_loss_scale = scale


@torch.no_grad()
def update_expert_bias(models: list[nn.Module], mesh: DeviceMesh | None = None) -> None:
    """After an optimizer step: sum each layer's load over ``mesh`` (the ranks that see
    different tokens: ``dp_cp``), step the bias of layers that use it, reset the counters."""
    for model in models:
        for layer in moe_layers(model):
            counts = layer.tokens_per_expert
            if layer.args.bias_update_rate > 0:
                if mesh is not None and mesh.size() > 1:
                    counts = counts.clone()
                    dist.all_reduce(counts, group=mesh.get_group())
                layer.update_bias(counts)
            layer.tokens_per_expert.zero_()
