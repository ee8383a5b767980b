"""Expert parallel: each rank of the ``ep`` mesh holds ``E / ep`` of every MoE layer's routed
experts, and tokens travel to their experts and back by all-to-all (docs/parallelisms.md,
"Expert parallel"; docs/moe.md).

The ``ep`` ranks are borrowed from data and context parallel (``dp_shard x cp = efsdp x ep``, ep
innermost): they see different tokens (other sequences, or other parts of the same sequences
under CP), and every token can go to any expert. The experts are FSDP-sharded over the remaining
``efsdp`` ranks and, under HSDP, replicated across ``dp_replicate`` (:func:`apply_expert_fsdp` on
``ParallelDims.get_mesh("expert_fsdp")``); with ``efsdp = 1`` and no replicas FSDP leaves them
alone. Model-agnostic, like every ``apply_*`` here: a module takes part by having
``enable_expert_parallel(mesh) -> list[nn.Parameter]`` (the shared MoE layer does), which turns
its stacked expert weights into DTensors sharded on dimension 0 over ``mesh`` and routes its
expert computation through :func:`run_experts`.

Gradients: an expert's weight gradient sums the contributions of the tokens of all ``ep`` ranks
(each already scaled by its rank's share of the loss: a mean over its own tokens), where data
parallel averages the gradients of the other weights over the ``dp_shard x cp`` (and
``dp_replicate``) ranks. :func:`scale_grad` divides the expert gradients by ``ep`` on their way
to the weights, and FSDP averages them over the other ``efsdp`` (and ``dp_replicate``) ranks, so
both are the gradient of the global-batch mean, as in one process. (Not a parameter hook:
``to_empty`` replaces DTensor parameters, dropping hooks.)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

__all__ = ["apply_ep", "apply_expert_fsdp", "run_experts", "scale_grad"]


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> list[nn.Parameter]:
    """Shard the experts of every participating module of ``model`` over ``ep_mesh``; returns
    the expert parameters (DTensors on ``ep_mesh``) for data parallel to leave alone."""
    params: list[nn.Parameter] = []
    for module in model.modules():
        enable = getattr(module, "enable_expert_parallel", None)
        if callable(enable):
            params.extend(enable(ep_mesh))
    return params


def apply_expert_fsdp(
    model: nn.Module,
    experts: list[nn.Parameter],
    efsdp_mesh: DeviceMesh,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: bool,
) -> None:
    """FSDP over ``efsdp_mesh`` (the data-parallel ranks left beside ``ep``; 2-D
    ``(dp_replicate, efsdp)`` for HSDP) for the modules holding ``experts``: each expert DTensor
    on ``ep`` is sharded further on dimension 0 (FSDP2's "TP/EP" layout on the ``(efsdp, ep)``
    mesh, replicated across the first axis under HSDP). Call before FSDP of the blocks, which
    then skips these nested units."""
    owned = {id(p) for p in experts}
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for module in model.modules():
        if any(id(p) in owned for p in module.parameters(recurse=False)):
            fully_shard(
                module, mesh=efsdp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward
            )


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad * ctx.scale, None


def scale_grad(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` unchanged; its gradient multiplied by ``scale`` in the backward."""
    return _ScaleGrad.apply(x, scale)


def run_experts(
    x: torch.Tensor,
    counts: torch.Tensor,
    experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ep_mesh: DeviceMesh,
) -> torch.Tensor:
    """``experts`` applied to the rows of ``x`` (sorted by global expert id, ``counts[e]`` rows
    for expert ``e``) where the experts live: rank ``r`` of ``ep_mesh`` holds experts
    ``r * E/ep .. (r+1) * E/ep - 1`` and ``experts(rows, local_counts)`` runs them.

    Dispatch: the per-expert counts are exchanged (all-to-all), then the rows (all-to-all with
    uneven splits; the split sizes need one host synchronisation); the received rows, ordered by
    source rank, are regrouped by local expert, run, put back in arrival order and returned by
    the reverse all-to-all. Both row all-to-alls are differentiable.
    """
    group = ep_mesh.get_group()
    ep = ep_mesh.size()
    local = counts.numel() // ep
    send = counts.view(ep, local)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    in_splits = send.sum(1).tolist()
    out_splits = recv.sum(1).tolist()
    received = funcol.all_to_all_single_autograd(x, out_splits, in_splits, group)
    expert_of_row = torch.arange(local, device=x.device).repeat(ep)
    expert_of_row = expert_of_row.repeat_interleave(recv.flatten())
    order = expert_of_row.argsort(stable=True)
    out = experts(received[order], recv.sum(0))
    out = out[order.argsort()]
    return funcol.all_to_all_single_autograd(out, in_splits, out_splits, group)
