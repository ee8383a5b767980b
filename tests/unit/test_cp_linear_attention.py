"""Qwen3.5's Gated DeltaNet under context parallel (docs/context_parallel.md, "Linear attention
(Gated DeltaNet) under context parallel"): the affine form of the delta rule, and one layer's
outputs and gradients on CP ranks against one process, with documents crossing the shards."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from tests.launcher import run_ranks
from tests.tiny_args import tiny_qwen3_5
from torchtitan.distributed.context_parallel.layout import (
    doc_ids_from_lengths,
    shard_index,
    take_tokens,
)
from torchtitan.models.common.attention import AttentionMask
from torchtitan.models.qwen3_5.delta_rule import (
    affine_delta_rule,
    chunked_delta_rule_state,
    recurrent_delta_rule,
)
from torchtitan.models.qwen3_5.layers import GatedDeltaNet

# Two windows of 48 tokens; documents of 1-17 tokens cross every CP shard boundary.
LENGTHS = [17, 5, 1, 9, 13, 3, 11, 7, 2, 15, 6, 8] * 2
SEQ = 48


def _rule_inputs(b: int = 2, s: int = 37, h: int = 3, dk: int = 8, dv: int = 6) -> list[Any]:
    g = torch.Generator().manual_seed(1)
    q, k = (
        torch.nn.functional.normalize(torch.randn(b, s, h, dk, generator=g), dim=-1) for _ in "qk"
    )
    v = torch.randn(b, s, h, dv, generator=g)
    decay = -torch.rand(b, s, h, generator=g)
    beta = torch.rand(b, s, h, generator=g)
    return [q * dk**-0.5, k, v, decay, beta]


@pytest.mark.parametrize("docs", [False, True])
def test_affine_form_equals_the_rule_from_any_state(docs: bool) -> None:
    """``o = o0 + S0^T qe`` and ``S_end = P S0 + B`` for a random entering state ``S0``: equal
    to the chunked rule started from ``S0``; from zero, to the recurrent definition. A document
    start inside the stretch cuts ``S0`` off (``P`` = 0 after it)."""
    q, k, v, g, beta = _rule_inputs()
    ids = doc_ids_from_lengths([20, 9, 30], 37)[:1].expand(2, -1) if docs else None
    s0 = torch.randn(2, 3, 8, 6, generator=torch.Generator().manual_seed(2))
    want, want_end = chunked_delta_rule_state(q, k, v, g, beta, ids, 16, initial_state=s0)
    o0, qe, trans, contrib = affine_delta_rule(q, k, v, g, beta, ids)
    got = o0 + torch.einsum("bshk,bhkv->bshv", qe, s0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(trans @ s0 + contrib, want_end, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        o0, recurrent_delta_rule(q, k, v, g, beta, ids), rtol=1e-5, atol=1e-5
    )
    assert (o0 - want).abs().max() > 1e-2, "the entering state changed nothing"
    if docs:
        assert trans.abs().max() == 0 and qe[:, 20:].abs().max() == 0
        torch.testing.assert_close(got[:, 20:], o0[:, 20:])


def _layer() -> tuple[GatedDeltaNet, torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    layer = GatedDeltaNet(tiny_qwen3_5())
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, SEQ, 64, generator=g)
    grad = torch.randn(2, SEQ, 64, generator=g)
    ids = doc_ids_from_lengths(LENGTHS, SEQ)[:2]
    return layer, x, grad, ids


def _cp_rank(balancer: str, docs: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    cp, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    torch.distributed.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    layer, x, grad, ids = _layer()
    layer.enable_context_parallel(mesh)
    idx = shard_index(SEQ, cp, rank, balancer, ids)
    pos = idx.expand(2, -1) if idx.dim() == 1 else idx
    mask = AttentionMask(take_tokens(ids, idx), positions=pos) if docs else None
    x_local = take_tokens(x, idx).requires_grad_()
    out = layer(x_local, torch.empty(0), mask)
    out.backward(take_tokens(grad, idx))
    return {
        "idx": pos.numpy(),
        "out": out.detach().numpy(),
        "grad_x": x_local.grad.numpy(),
        "grads": {n: p.grad.numpy() for n, p in layer.named_parameters()},
    }


@pytest.mark.parametrize(
    "cp, balancer, docs",
    [
        (2, "document", True),
        (2, "headtail", False),
        pytest.param(4, "headtail", True, marks=pytest.mark.slow),
        pytest.param(3, "document", True, marks=pytest.mark.slow),
    ],
)
def test_deltanet_layer_equals_one_process(cp: int, balancer: str, docs: bool) -> None:
    """The layer's outputs, input gradients and (summed over ranks) parameter gradients on cp
    ranks equal one process's at the same tokens: the state and the convolution window cross
    the ranks in sequence order and reset at documents, whatever order the balancer chose."""
    layer, x, grad, ids = _layer()
    x = x.clone().requires_grad_()
    mask = AttentionMask(ids) if docs else None
    out = layer(x, torch.empty(0), mask)
    out.backward(grad)
    results = run_ranks(_cp_rank, cp, balancer, docs, timeout=120)
    for r in results:
        idx = torch.from_numpy(r["idx"])
        want = take_tokens(out.detach(), idx)
        torch.testing.assert_close(torch.from_numpy(r["out"]), want, rtol=1e-5, atol=1e-5)
        want_gx = take_tokens(x.grad, idx)
        torch.testing.assert_close(torch.from_numpy(r["grad_x"]), want_gx, **_tol(want_gx))
    for name, p in layer.named_parameters():
        got = sum(torch.from_numpy(r["grads"][name]) for r in results)
        assert isinstance(got, torch.Tensor) and p.grad is not None
        torch.testing.assert_close(got, p.grad, **_tol(p.grad), msg=name)


def _tol(want: torch.Tensor) -> dict[str, float]:
    """1e-5 relative, and 1e-5 of the largest entry (gradients reach ~900 here, float32
    sums of many terms ordered differently on cp ranks: measured within 7e-6 of it)."""
    return {"rtol": 1e-5, "atol": 1e-5 * float(want.abs().max())}
