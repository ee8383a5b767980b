"""Tier 3: the total gradient norm and clipping across meshes, on 2 gloo ranks.

Gradients of every kind a parallel model produces are mixed in one call: plain tensors,
DTensors sharded (FSDP/TP), replicated, and partial (a sequence-parallel norm weight's gradient
before its reduction), on two different meshes; and pipeline stages holding different
parameters. The norm must equal the norm of the full gradients, computed here by hand.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.launcher import run_ranks


def _norms() -> dict[str, float]:
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    from torchtitan.distributed.utils import clip_grad_norm_

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh_a = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    mesh_b = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    gen = torch.Generator().manual_seed(0)  # the same full values on both ranks
    full = {
        n: torch.randn(shape, generator=gen)
        for n, shape in [
            ("plain", (3, 5)),
            ("sharded", (8, 4)),
            ("replicated", (7,)),
            ("sharded_b", (6, 2)),
        ]
    }
    partial_locals = [torch.randn(5, generator=gen) for _ in range(2)]

    def param(grad: torch.Tensor) -> nn.Parameter:
        p = nn.Parameter(torch.zeros_like(grad))  # a DTensor like its gradient, or a tensor
        p.grad = grad
        return p

    grads = [
        full["plain"].clone(),
        DTensor.from_local(full["sharded"].chunk(2)[rank].clone(), mesh_a, [Shard(0)]),
        DTensor.from_local(full["replicated"].clone(), mesh_a, [Replicate()]),
        DTensor.from_local(partial_locals[rank].clone(), mesh_a, [Partial()]),
        DTensor.from_local(full["sharded_b"].chunk(2, dim=1)[rank].clone(), mesh_b, [Shard(1)]),
    ]
    want = torch.cat(
        [
            full["plain"].flatten(),
            full["sharded"].flatten(),
            full["replicated"],
            partial_locals[0] + partial_locals[1],
            full["sharded_b"].flatten(),
        ]
    )
    out = {"want": want.norm().item(), "want_inf": want.abs().max().item()}
    out["got"] = clip_grad_norm_([param(g) for g in grads], 0.0).item()
    out["got_inf"] = clip_grad_norm_([param(g) for g in grads], 0.0, norm_type=math.inf).item()
    # Clipping to half the norm halves every gradient, shards included.
    params = [param(g.clone()) for g in grads]
    clip_grad_norm_(params, out["want"] / 2)
    sharded = params[1].grad.full_tensor()  # type: ignore[union-attr]
    out["clip_ratio"] = (sharded.norm() / full["sharded"].norm()).item()
    out["clip_ratio_plain"] = (params[0].grad.norm() / full["plain"].norm()).item()  # type: ignore[union-attr]
    # The partial gradient (a sequence-parallel norm weight's) is summed, then halved too (torch
    # 2.11 scaled it wrongly in place while it was still partial).
    partial = params[3].grad.full_tensor()  # type: ignore[union-attr]
    out["clip_ratio_partial"] = (
        partial.norm() / (partial_locals[0] + partial_locals[1]).norm()
    ).item()

    # Pipeline stages: each rank holds different parameters; the norm covers both.
    stage = torch.full((4,), float(rank + 1))  # rank 0: 1s, rank 1: 2s
    out["pp"] = clip_grad_norm_([param(stage)], 0.0, pp_mesh=mesh_b).item()
    out["pp_want"] = math.sqrt(4 * 1 + 4 * 4)
    out["pp_inf"] = clip_grad_norm_([param(stage)], 0.0, norm_type=math.inf, pp_mesh=mesh_b).item()

    # One all-reduce completes every gradient sharded over the same mesh axis (not one each).
    calls = []
    real = dist.all_reduce
    dist.all_reduce = lambda t, *a, **k: (calls.append(1), real(t, *a, **k))[1]  # type: ignore[assignment]
    many = [
        DTensor.from_local(torch.randn(4, generator=gen), mesh_a, [Shard(0)]) for _ in range(40)
    ]
    # Five pending sums (sequence-parallel norm weights') reduced together, then replicated.
    partials = [
        DTensor.from_local(torch.full((3,), float(rank + i)), mesh_a, [Partial()]) for i in range(5)
    ]
    try:
        clip_grad_norm_([param(g) for g in many], 0.0)
        out["all_reduces_for_40"] = len(calls)
        calls.clear()
        out["partial_norm"] = clip_grad_norm_([param(g) for g in partials], 0.0).item()
        out["all_reduces_for_5_partial"] = len(calls)
    finally:
        dist.all_reduce = real
    out["partial_want"] = math.sqrt(sum(3 * (2 * i + 1) ** 2 for i in range(5)))

    # FSDP x TP's strided shards (not ``is_shard()`` on torch 2.13) are completed too.
    from torch.distributed.tensor.placement_types import _StridedShard

    strided = DTensor.from_local(
        torch.full((2, 3), float(rank + 1)), mesh_a, [_StridedShard(0, split_factor=2)]
    )
    out["strided"] = clip_grad_norm_([param(strided)], 0.0).item()
    out["strided_want"] = math.sqrt(6 * 1 + 6 * 4)
    return out


@pytest.mark.smoke
def test_total_norm_and_clipping_across_meshes_and_stages() -> None:
    results = run_ranks(_norms, 2)
    for rank, r in enumerate(results):
        assert math.isclose(r["got"], r["want"], rel_tol=1e-6), (rank, r)
        assert math.isclose(r["got_inf"], r["want_inf"], rel_tol=1e-6), (rank, r)
        assert math.isclose(r["clip_ratio"], 0.5, rel_tol=1e-4), (rank, r)
        assert math.isclose(r["clip_ratio_plain"], 0.5, rel_tol=1e-4), (rank, r)
        assert math.isclose(r["clip_ratio_partial"], 0.5, rel_tol=1e-4), (rank, r)
        assert math.isclose(r["pp"], r["pp_want"], rel_tol=1e-6), (rank, r)
        assert r["pp_inf"] == 2.0, (rank, r)
        assert r["all_reduces_for_40"] == 1, (rank, r)
        assert r["all_reduces_for_5_partial"] == 1, (rank, r)
        assert math.isclose(r["strided"], r["strided_want"], rel_tol=1e-6), (rank, r)
        assert math.isclose(r["partial_norm"], r["partial_want"], rel_tol=1e-6), (rank, r)
