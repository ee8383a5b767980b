"""Mixture-of-Experts feed-forward shared by model families (docs/moe.md).

One :class:`MoE` layer = a :class:`Router` (scores, optional group-limited top-k, score
normalisation), routed SwiGLU experts held as stacked ``[E, ...]`` weights (:class:`Experts`) and
optional shared experts every token runs. Dispatch is dropless: every token reaches its ``top_k``
experts, whatever the load; tokens are sorted by expert and the experts run as one grouped GEMM
(``torch._grouped_mm``) where the device and dtype support it (probed once), an exact per-expert
loop elsewhere. The router is in ``moe_router.py``, the experts in ``moe_experts.py``.

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
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from torchtitan.config.errors import ConfigError
from torchtitan.distributed import float8_grouped
from torchtitan.distributed.expert_parallel import run_experts
from torchtitan.distributed.float8_grouped import PaddedGroups
from torchtitan.models.common.moe_experts import Experts, SharedExpert, grouped_mm_supported
from torchtitan.models.common.moe_router import MoEArgs, Router

__all__ = [
    "MoE",
    "MoEArgs",
    "collect_aux_loss",
    "grouped_mm_supported",
    "moe_overrides",
    "set_aux_loss_scale",
    "update_expert_bias",
]


class MoE(nn.Module):
    """``[B, S, dim] -> [B, S, dim]``: routed experts (+ shared experts), dropless.

    Under torch.compile the routed experts run eagerly (one graph break) where they cannot be
    traced: under expert parallel (the all-to-all split sizes are data on the device, read by
    the host) and where compile has no grouped-GEMM kernel for the dtype (torch 2.13: fp32).
    Everything else of the layer (router, auxiliary loss, sort, combine, shared expert) is
    compiled; ``compile_graph_breaks`` tells ``apply_compile`` to allow the break.
    """

    compile_graph_breaks = True
    float8_exempt = True
    """Float8 training (``distributed/float8.py``) leaves the whole layer in high precision:
    the router's scores pick the experts (a rounding flips top-k choices) and its GEMM is only
    ``E`` wide; the routed experts are stacked weights run by the grouped GEMM, not
    ``nn.Linear`` (a float8 grouped GEMM is CUDA-only in torchao and not wired here); the shared
    expert applies its weights with ``F.linear`` on their local values (for tensor parallel's
    ``ReplicateParallel``), which a ``Float8Linear`` swap would never reach."""

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
        self.cp_mesh: DeviceMesh | None = None
        """Set by context parallel (:meth:`enable_context_parallel`)."""

    def enable_context_parallel(self, mesh: DeviceMesh) -> None:
        """Under context parallel this rank sees part of every sequence: the sequence-wise
        auxiliary loss then takes each expert's share of the slots over the whole sequence
        (summed over ``mesh``, docs/moe.md)."""
        self.cp_mesh = mesh if mesh.size() > 1 else None

    def enable_expert_parallel(self, mesh: DeviceMesh) -> list[nn.Parameter]:
        """Shard the routed experts on dimension 0 over ``mesh`` (``distributed/
        expert_parallel.py``); returns the sharded parameters."""
        if self.args.num_experts % mesh.size() != 0:
            raise ValueError(f"{self.args.num_experts} experts cannot split over {mesh.size()}")
        # Every stacked [E, ...] parameter: w1/w2/w3 and any per-expert adapters (docs/lora.md).
        for name, weight in list(self.experts.named_parameters(recurse=False)):
            dt = distribute_tensor(weight.data, mesh, [Shard(0)])
            setattr(self.experts, name, nn.Parameter(dt, weight.requires_grad))
        self.ep_mesh = mesh
        self.experts.grad_scale = 1.0 / mesh.size()
        return list(self.experts.parameters(recurse=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, seqlen, dim = x.shape
        flat = x.reshape(-1, dim)
        idx, weights, scores = self.router(flat)
        # Slots per expert (a fixed-size result, unlike bincount's, so compile needs no guard).
        counts = idx.new_zeros(self.args.num_experts)
        counts.scatter_add_(0, idx.flatten(), torch.ones_like(idx.flatten()))
        # The device-side statistics count each forward once: not again when activation
        # checkpointing recomputes this layer in the backward.
        record = self.training and not _recomputing()
        if record:
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
            if record:
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
        if (
            self.ep_mesh is None
            and isinstance(self.experts, Experts)
            and self.experts.float8 != "off"
        ):
            return self._dispatch_padded(x, token, weights.flatten()[order], counts)
        rows = x[token]
        if torch.compiler.is_compiling() and (
            self.ep_mesh is not None or not self.experts.traceable(rows)
        ):
            out = _eager(self._run_experts, rows, counts)  # a graph break: see the class docstring
        else:
            out = self._run_experts(rows, counts)
        out = out * weights.flatten()[order, None]
        return torch.zeros_like(x).index_add_(0, token, out)

    def _dispatch_padded(
        self, x: torch.Tensor, token: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        """:meth:`dispatch_and_combine` for float8 experts on this rank: each slot's token row is
        gathered straight into the float8 GEMMs' padded layout and the weighted products are
        summed back from it (docs/float8.md, "Copies around the float8 GEMM"). Padding rows read
        and write a zero row past the tokens; every real row equals the unpadded path's."""
        t, dim = x.shape
        size, offs, where = float8_grouped.padded_layout(counts, token.numel(), whole=True)
        src = token.new_full((size,), t).index_copy(0, where, token)  # buffer row -> token
        buffer = torch.cat([x, x.new_zeros(1, dim)])[src]
        groups = PaddedGroups(counts, offs, where)
        if torch.compiler.is_compiling() and not self.experts.traceable(buffer):
            out = _eager(self.experts.forward_padded, buffer, groups)
        else:
            out = self.experts.forward_padded(buffer, groups)
        out = out * weights.new_zeros(size).index_copy(0, where, weights)[:, None]
        return x.new_zeros(t + 1, dim).index_add_(0, src, out)[:t]

    def _run_experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if self.ep_mesh is None:
            return self.experts(rows, counts)
        return run_experts(rows, counts, self.experts, self.ep_mesh)

    def _aux_loss(self, idx: torch.Tensor, scores: torch.Tensor, bs: int) -> torch.Tensor:
        e = self.args.num_experts
        seq = scores.view(bs, -1, e)
        probs = seq / seq.sum(-1, keepdim=True) if self.args.score_func == "sigmoid" else seq
        load = _slot_share(idx.view(bs, -1), e)  # [B, E]: share of slots
        if self.cp_mesh is not None:
            # The share over the whole sequence (the cp ranks hold equal parts of it). ``probs``
            # stays this rank's mean: the cp ranks' losses then average to the one-process
            # loss, and so do their gradients (FSDP averages over dp_shard x cp).
            load = funcol.all_reduce(load, "sum", self.cp_mesh) / self.cp_mesh.size()
        balance = e * (load * probs.mean(1)).sum(-1)  # [B], 1.0 when perfectly balanced
        return self.args.aux_loss_coef * balance.mean()

    @torch.no_grad()
    def update_bias(self, counts: torch.Tensor) -> None:
        """One auxiliary-loss-free step: ``bias += rate * sign(mean(counts) - counts)``."""
        rate = self.args.bias_update_rate
        bias = self.router.expert_bias
        bias += rate * torch.sign(counts.mean() - counts).to(bias.dtype)


def _slot_share(idx: torch.Tensor, e: int) -> torch.Tensor:
    """``[B, n]`` expert ids -> ``[B, E]`` each expert's share of a row's ``n`` slots: the mean of
    their one-hot rows, counted by a scatter-add instead of materialising ``[B, n, E]`` (integer
    counts are exact in fp32 below 2**24 slots, so the two are equal bitwise)."""
    ones = torch.ones_like(idx, dtype=torch.float32)
    counts = ones.new_zeros(idx.shape[0], e).scatter_add_(1, idx, ones)
    return counts / idx.shape[1]


@torch.compiler.disable
def _eager(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` run eagerly, outside any compiled graph."""
    return fn(*args)


def _recomputing() -> bool:
    """Whether this forward runs inside the backward: non-reentrant activation checkpointing
    recomputing the layer. (Compiled checkpointed regions replay no Python side effects.)"""
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1


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
    """``args`` with ``model.moe_aux_loss_coef`` / ``model.moe_bias_update_rate`` /
    ``model.moe_num_experts`` applied to its ``moe`` field where they are set (>= 0); preflight
    refuses them for a model without one. An expert count the routing cannot use (groups,
    top-k) is a ``ConfigError``."""
    moe = getattr(args, "moe", None)
    changes: dict[str, Any] = {
        "aux_loss_coef": model_cfg.moe_aux_loss_coef,
        "bias_update_rate": model_cfg.moe_bias_update_rate,
        "num_experts": getattr(model_cfg, "moe_num_experts", -1),
    }
    changes = {k: v for k, v in changes.items() if v >= 0}
    if moe is None or not changes:
        return args
    try:
        moe = dataclasses.replace(moe, **changes)
    except ValueError as e:
        raise ConfigError(
            "model.moe_num_experts",
            changes.get("num_experts"),
            f"the flavor's routing cannot use it ({e})",
            f"use a multiple of n_groups={moe.n_groups} with top_k={moe.top_k} within reach",
        ) from None
    return dataclasses.replace(args, moe=moe)


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def collect_aux_loss(model: nn.Module) -> torch.Tensor | None:
    """The sum of the MoE layers' auxiliary losses of the last forward (detached), or None."""
    losses = [m.aux_loss for m in moe_layers(model) if m.aux_loss is not None]
    return torch.stack(losses).sum() if losses else None


def set_aux_loss_scale(models: list[nn.Module], scale: float) -> None:
    """The gradient seed of every auxiliary loss: the factor the training loss of one forward
    gets (``1 / (grad_accum_steps x pipeline microbatches)``). Set on every module with an
    ``aux_loss_scale``: the MoE layers and others that attach a loss the same way (DeepSeek-V3's
    multi-token prediction, docs/deepseek_v3.md)."""
    for model in models:
        for module in model.modules():
            if hasattr(module, "aux_loss_scale"):
                setattr(module, "aux_loss_scale", scale)  # noqa: B010 (any module type)


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
