"""The shared MoE layer (docs/moe.md): grouped GEMM equals the per-expert loop, dropless dispatch
equals a dense reference, router properties, group-limited routing, the auxiliary loss and its
gradient, and the direction of the auxiliary-loss-free bias update."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchtitan.models.common.moe import (
    MoE,
    MoEArgs,
    collect_aux_loss,
    grouped_mm_supported,
    set_aux_loss_scale,
    update_expert_bias,
)
from torchtitan.models.common.moe_experts import compute_dtype

DIM = 32


def _layer(args: MoEArgs, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    layer = MoE(DIM, args)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.2)
    return layer


def _reference(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """Every token through every expert, weighted by its (dense, mostly zero) routing weight."""
    flat = x.reshape(-1, DIM)
    idx, weights, _ = layer.router(flat)
    dense = torch.zeros(flat.shape[0], layer.args.num_experts).scatter(1, idx, weights)
    e = layer.experts
    out = torch.zeros_like(flat)
    for i in range(layer.args.num_experts):
        h = F.silu(flat @ e.w1[i]) * (flat @ e.w3[i])
        out += dense[:, i : i + 1] * (h @ e.w2[i])
    if layer.shared is not None:
        out += layer.shared(flat)
    return out.view_as(x)


@pytest.mark.skipif(not grouped_mm_supported("cpu", torch.float32), reason="no grouped_mm here")
def test_grouped_mm_equals_the_per_expert_loop() -> None:
    layer = _layer(MoEArgs(num_experts=8, top_k=2, expert_dim=16, num_shared_experts=1))
    x = torch.randn(3, 20, DIM, requires_grad=True)
    outs, grads = [], []
    for grouped in (True, False):
        layer.experts.use_grouped_mm = grouped
        layer.zero_grad()
        x.grad = None
        out = layer(x)
        out.square().sum().backward()
        outs.append(out.detach())
        grads.append([x.grad.clone(), *(p.grad.clone() for p in layer.experts.parameters())])
    diff = (outs[0] - outs[1]).abs().max().item()
    gdiff = max((a - b).abs().max().item() for a, b in zip(*grads))
    print(f"grouped_mm vs loop: max abs diff {diff:.1e} (outputs), {gdiff:.1e} (gradients)")
    assert diff <= 1e-6 and gdiff <= 1e-5


@pytest.mark.skipif(not grouped_mm_supported("cpu", torch.bfloat16), reason="no grouped_mm here")
def test_experts_follow_autocast() -> None:
    """Under autocast (mixed precision without FSDP) the experts multiply in autocast's dtype
    whatever the rows' dtype: bf16 rows with fp32 weights (what a block after a bf16 projection
    gives them) ran ``torch._grouped_mm`` on mixed dtypes and failed. Both paths and both row
    dtypes agree, and the fp32 weights get fp32 gradients."""
    layer = _layer(MoEArgs(num_experts=8, top_k=2, expert_dim=16))
    outs, grads = [], []
    for rows_dtype in (torch.bfloat16, torch.float32):
        for grouped in (True, False):
            layer.experts.use_grouped_mm = grouped
            layer.zero_grad()
            x = torch.randn(3, 20, DIM, generator=torch.Generator().manual_seed(4))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = layer(x.to(rows_dtype))
            out.float().square().sum().backward()
            assert layer.experts.w1.grad.dtype == torch.float32
            outs.append(out.detach().float())
            grads.append(layer.experts.w1.grad.clone())
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a device autocast has no rule for
        assert compute_dtype(torch.empty(2, device="meta")) == torch.float32
    for out, grad in zip(outs[1:], grads[1:]):
        assert (out - outs[0]).abs().max().item() <= 2e-2
        assert ((grad - grads[0]).norm() / grads[0].norm()).item() <= 2e-2


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_dropless_dispatch_equals_dense_reference(score_func: str) -> None:
    args = MoEArgs(
        num_experts=8, top_k=3, expert_dim=16, num_shared_experts=1, score_func=score_func
    )  # type: ignore[arg-type]
    layer = _layer(args)
    x = torch.randn(2, 16, DIM)
    diff = (layer(x) - _reference(layer, x)).abs().max().item()
    assert diff <= 1e-5, diff


def test_router_properties() -> None:
    layer = _layer(MoEArgs(num_experts=8, top_k=2, expert_dim=16, route_scale=2.5))
    idx, weights, scores = layer.router(torch.randn(50, DIM))
    assert idx.shape == (50, 2) and (idx[:, 0] != idx[:, 1]).all()
    assert torch.allclose(weights.sum(-1), torch.full((50,), 2.5))  # normalised, then scaled
    assert torch.allclose(scores.sum(-1), torch.ones(50))
    assert torch.equal(idx, scores.topk(2).indices)  # the best-scored experts
    sig = _layer(
        MoEArgs(num_experts=8, top_k=2, expert_dim=16, score_func="sigmoid", route_norm=False)
    )
    idx, weights, scores = sig.router(torch.randn(50, DIM))
    assert torch.equal(weights, scores.gather(1, idx))  # raw sigmoid scores


def test_group_limited_routing_stays_in_the_best_groups() -> None:
    args = MoEArgs(
        num_experts=16, top_k=4, expert_dim=8, n_groups=4, topk_groups=2, score_func="sigmoid"
    )
    layer = _layer(args)
    idx, _, scores = layer.router(torch.randn(200, DIM))
    groups = idx // 4
    best = scores.view(200, 4, 4).topk(2, dim=-1).values.sum(-1).topk(2, dim=-1).indices
    for t in range(200):
        assert set(groups[t].tolist()) <= set(best[t].tolist())
    assert len({tuple(sorted(set(g.tolist()))) for g in groups}) > 1  # not always the same groups


def test_aux_loss_value_and_gradient() -> None:
    args = MoEArgs(num_experts=4, top_k=2, expert_dim=8, aux_loss_coef=0.1)
    layer = _layer(args)
    x = torch.randn(3, 10, DIM)
    # The gradient seeded by the layer equals d(loss + scale * aux) of an explicit sum.
    set_aux_loss_scale([layer], 0.5)
    layer(x).sum().backward()
    seeded = layer.router.gate.weight.grad.clone()
    layer.zero_grad()
    flat = x.reshape(-1, DIM)
    idx, weights, scores = layer.router(flat)
    explicit = layer._aux_loss(idx, scores, 3)
    out = layer.dispatch_and_combine(flat, idx, weights, torch.bincount(idx.flatten(), minlength=4))
    (out.sum() + 0.5 * explicit).backward()
    assert torch.allclose(seeded, layer.router.gate.weight.grad, atol=1e-6)
    aux = collect_aux_loss(layer)
    assert aux is not None and torch.allclose(aux, explicit.detach())
    # Perfect balance (uniform scores, every expert equally loaded) gives exactly coef * 1.
    uniform = torch.full((1, 8, 4), 0.25)
    balanced = torch.tensor([[0, 1], [2, 3]] * 4)
    assert layer._aux_loss(balanced, uniform.view(8, 4), 1).item() == pytest.approx(0.1)
    # Collapsed routing costs more.
    skewed = torch.tensor([[0, 1]] * 8)
    peaked = torch.tensor([[0.5, 0.5, 0.0, 0.0]] * 8)
    assert layer._aux_loss(skewed, peaked, 1).item() == pytest.approx(0.2)


def test_bias_update_moves_load_towards_balance() -> None:
    args = MoEArgs(num_experts=4, top_k=1, expert_dim=8, bias_update_rate=0.01)
    layer = _layer(args)
    layer.train()
    layer.tokens_per_expert.copy_(torch.tensor([10.0, 0.0, 5.0, 5.0]))
    update_expert_bias([layer])
    # Over-loaded expert 0 down, idle expert 1 up, the average ones unchanged; counters reset.
    assert torch.equal(layer.router.expert_bias, torch.tensor([-0.01, 0.01, 0.0, 0.0]))
    assert not layer.tokens_per_expert.any()
    # The bias changes the selection, not the weights: a large bias forces expert 3.
    layer.router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 10.0]))
    idx, weights, scores = layer.router(torch.randn(20, DIM))
    assert (idx == 3).all() and torch.allclose(weights, torch.ones(20, 1))
    layer(torch.randn(2, 5, DIM))
    assert layer.tokens_per_expert.tolist() == [0.0, 0.0, 0.0, 10.0]
