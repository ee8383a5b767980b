"""``compile.enable`` with Qwen3.5's Gated DeltaNet under context parallel
(docs/context_parallel.md, "Linear attention (Gated DeltaNet) under context parallel"): one
DeltaNet layer compiled the way training compiles a block (``distributed/compile.py:
apply_compile``, ``fullgraph=False`` since the layer declares graph breaks under CP) gives the
eager layer's outputs and gradients on the same CP 2 ranks."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn

from tests.launcher import run_ranks
from tests.unit.test_cp_linear_attention import SEQ, _layer, _tol
from torchtitan.distributed.compile import apply_compile
from torchtitan.distributed.context_parallel.layout import shard_index, take_tokens
from torchtitan.models.common.attention import AttentionMask


def _eager_then_compiled(balancer: str) -> dict[str, Any]:
    """This rank's outputs, input and parameter gradients, eager and then compiled."""
    from torch.distributed.device_mesh import init_device_mesh

    cp, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    torch.distributed.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    layer, x, grad, ids = _layer()
    layer.enable_context_parallel(mesh)
    idx = shard_index(SEQ, cp, rank, balancer, ids)
    pos = idx.expand(2, -1) if idx.dim() == 1 else idx
    mask = AttentionMask(take_tokens(ids, idx), positions=pos)
    runs = []
    for compiled in (False, True):
        if compiled:
            apply_compile(nn.ModuleDict({"0": layer}))
        layer.zero_grad()
        x_local = take_tokens(x, idx).requires_grad_()
        out = layer(x_local, torch.empty(0), mask)
        out.backward(take_tokens(grad, idx))
        grads = {
            n: p.grad.numpy().copy() for n, p in layer.named_parameters() if p.grad is not None
        }
        runs.append({"out": out.detach().numpy(), "grad_x": x_local.grad.numpy(), **grads})
    from torch._dynamo.utils import counters

    graphs = int(counters["stats"]["unique_graphs"])  # dynamo really compiled the layer
    return {"eager": runs[0], "compiled": runs[1], "graphs": graphs}


@pytest.mark.slow  # inductor compiles the layer's forward and backward: ~4 min on 2 loaded cores
def test_compiled_deltanet_cp2_equals_eager() -> None:
    """Compiled CP 2 (document balancer, documents of 1-17 tokens crossing the shards) equals
    eager CP 2: outputs to 1e-5, input and parameter gradients to 1e-5 of their largest entry."""
    results = run_ranks(_eager_then_compiled, 2, "document", timeout=900)
    for r in results:
        assert r["graphs"] > 0
        eager, compiled = r["eager"], r["compiled"]
        assert set(eager) == set(compiled) and len(eager) > 3
        for name, want_np in eager.items():
            want, got = torch.from_numpy(want_np), torch.from_numpy(compiled[name])
            tol = {"rtol": 1e-5, "atol": 1e-5} if name == "out" else _tol(want)
            torch.testing.assert_close(got, want, **tol, msg=name)
