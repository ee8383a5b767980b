"""The copies around the routed experts' GEMMs (docs/float8.md, "Copies around the float8 GEMM"):
the float8 SwiGLU padded once instead of once per projection, the shared layer's dispatch
straight into the padded layout, and the auxiliary loss's slot shares counted without a one-hot
tensor, each equal bitwise to the path it replaces, and the elements the replaced copies
allocated counted."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import torchtitan.distributed.float8_grouped as fg
from torchtitan.models.common.moe import MoE, _slot_share
from torchtitan.models.common.moe_experts import Experts, StackedExperts

Forward = Callable[[StackedExperts, torch.Tensor, torch.Tensor], torch.Tensor]


def per_projection(ex: StackedExperts, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The float8 SwiGLU as it was: every projection pads its rows and gathers its output."""
    g = ex._grouped(x)
    h = F.silu(ex.project(x, "w1", counts, g)) * ex.project(x, "w3", counts, g)
    return ex.project(h, "w2", counts, g)


def padded_once(ex: StackedExperts, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    return ex(x, counts)


def _experts(e: int, dim: int, hidden: int, device: str = "cpu") -> Experts:
    torch.manual_seed(0)
    ex = Experts(e, dim, hidden).to(device)
    with torch.no_grad():
        for p in ex.parameters():
            p.normal_(0.0, 0.1)
    ex.float8 = "emulated"
    return ex


def _counts(e: int, rows: int, seed: int) -> torch.Tensor:
    """Rows per expert, skewed, with an empty expert (expert 1)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, e, (rows,), generator=gen) ** 2 % e
    ids[ids == 1] = 0
    return torch.bincount(ids, minlength=e)


def _run(ex: StackedExperts, fwd: Forward, x: torch.Tensor, counts: torch.Tensor, autocast: bool):
    ex.zero_grad()
    x = x.detach().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = fwd(ex, x, counts)
    (out.float().square().sum() + out.float().sum()).backward()
    grads = [p.grad for p in ex.parameters() if p.grad is not None]
    return out.detach(), x.grad, grads


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_float8_swiglu_padded_once_is_bitwise_equal(seed: int, autocast: bool) -> None:
    """Output, input gradient and the three weight gradients of the float8 (emulated) SwiGLU
    padded once equal the per-projection padding's bitwise (fp32 and bf16 autocast; an expert
    with no rows, groups not multiples of 16, the last group over the buffer's tail)."""
    ex = _experts(8, 64, 32)
    counts = _counts(8, 200, seed)
    x = torch.randn(200, 64, generator=torch.Generator().manual_seed(seed))
    ref = _run(ex, per_projection, x, counts, autocast)
    new = _run(ex, padded_once, x, counts, autocast)
    assert counts[1] == 0 and len(ref[2]) == len(new[2]) == 3
    assert torch.equal(new[0], ref[0]) and torch.equal(new[1], ref[1])
    assert all(torch.equal(a, b) for a, b in zip(new[2], ref[2]))
    assert ref[0].abs().sum() > 0 and all(g.abs().sum() > 0 for g in ref[2])


def test_lora_on_float8_swiglu_padded_once_is_bitwise_equal() -> None:
    """Per-expert adapters on the padded float8 base (dropout on: its draws come from the real
    rows, as before) equal the per-projection path's output and adapter gradients bitwise."""
    from torchtitan.lora.layers import adapt_experts

    ex = _experts(8, 64, 32)
    adapt_experts(ex, ("w1", "w2"), rank=4, scaling=2.0, dropout=0.1)
    for name, p in ex.named_parameters():
        if name.startswith("lora"):
            torch.nn.init.normal_(p, std=0.1)
    counts = _counts(8, 160, 2)
    x = torch.randn(160, 64)
    results = []
    for fwd in (per_projection, padded_once):
        torch.manual_seed(5)  # the same dropout draws
        results.append(_run(ex, fwd, x, counts, autocast=False))
    (ref_out, ref_dx, ref_g), (out, dx, g) = results
    assert torch.equal(out, ref_out) and torch.equal(dx, ref_dx) and len(g) == len(ref_g) == 7
    assert all(torch.equal(a, b) for a, b in zip(g, ref_g))


def _old_dispatch(layer: MoE, flat: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, counts):
    """The dispatch as it was: gather the slots' rows, the per-projection float8 SwiGLU, weight
    each slot and sum every token's slots."""
    order = idx.flatten().argsort(stable=True)
    token = order // idx.shape[1]
    out = per_projection(layer.experts, flat[token], counts) * w.flatten()[order, None]
    return torch.zeros_like(flat).index_add_(0, token, out)


@pytest.mark.parametrize("autocast,lora", [(False, False), (True, False), (False, True)])
def test_dispatch_into_padded_layout_is_bitwise_equal(autocast: bool, lora: bool) -> None:
    """Float8 experts on this rank: the slots gathered straight into the padded layout and
    combined from it give the old dispatch's output, input, router and expert (or adapter,
    dropout on) gradients bitwise."""
    from tests.unit.test_moe_compose import _layer
    from torchtitan.lora.layers import adapt_experts

    layer = _layer()
    fg.apply_float8_experts(layer, emulate=True, device_type="cpu")
    if lora:
        adapt_experts(layer.experts, ("w1", "w2"), rank=4, scaling=2.0, dropout=0.1)
        for name, p in layer.experts.named_parameters():
            if name.startswith("lora"):
                torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(3, 16, 64)
    results = []
    for dispatch in (_old_dispatch, MoE.dispatch_and_combine):
        torch.manual_seed(5)  # the same dropout draws
        layer.zero_grad()
        flat = x.reshape(-1, 64).clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            idx, w, _ = layer.router(flat)
            counts = torch.bincount(idx.flatten(), minlength=8)
            out = dispatch(layer, flat, idx, w.to(flat.dtype), counts)
        (out.float().square().sum() + out.float().sum()).backward()
        grads = [p.grad for p in layer.parameters() if p.grad is not None]
        results.append((out.detach(), flat.grad, grads))
    (ref, ref_dx, ref_g), (new, dx, g) = results
    assert (
        torch.equal(new, ref) and torch.equal(dx, ref_dx) and len(g) == len(ref_g) == 4 + 4 * lora
    )
    assert all(torch.equal(a, b) for a, b in zip(g, ref_g))


_MUTED = threading.local()


class _Allocated(TorchDispatchMode):
    """Elements of every tensor a non-view op returns, by op, outside the float8 GEMM itself."""

    def __init__(self) -> None:
        super().__init__()
        self.elements: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        out = func(*args, **(kwargs or {}))
        if not getattr(_MUTED, "on", False) and not func.is_view:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.elements[func.overloadpacket.__name__] += t.numel()
        return out


@contextmanager
def _gemm_muted(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The emulated float8 GEMM (forward and backward) uncounted: on a GPU it is torchao's
    kernels, the same for both paths; what is left is the work around it."""
    cls = fg._EmulatedFloat8GroupedMM
    for name in ("forward", "backward"):
        fn = getattr(cls, name)

        def muted(*args: Any, _fn: Any = fn) -> Any:
            _MUTED.on = True
            try:
                return _fn(*args)
            finally:
                _MUTED.on = False

        monkeypatch.setattr(cls, name, staticmethod(muted))
    yield


def count_around_gemm(
    fwd: Forward, e: int, dim: int, hidden: int, rows: int, device: str = "cpu"
) -> collections.Counter[str]:
    """Elements allocated by one float8 SwiGLU forward + backward outside its GEMMs, by op."""
    ex = _experts(e, dim, hidden, device)
    counts = torch.full((e,), rows // e, device=device)  # any split: the sizes are static
    x = torch.randn(rows, dim, device=device, requires_grad=True)
    mode = _Allocated()
    with mode:
        fwd(ex, x, counts).sum().backward()
    return mode.elements


def test_padding_once_allocates_fewer_elements(monkeypatch: pytest.MonkeyPatch) -> None:
    """At the debug MoE's expert shape (8 experts of 256 x 128, 8 x 64 tokens x top-2 = 1024
    rows), one forward + backward: the layout copies (zero buffers, index copies, gathers and
    their backward scatters) of three paddings against one, op by op, and the activation's
    extra padding rows. (The Qwen3-30B-A3B row, docs/float8.md: the same count on meta.)"""
    e, dim, hidden, n = 8, 256, 128, 1024
    with _gemm_muted(monkeypatch):
        old = count_around_gemm(per_projection, e, dim, hidden, n)
        new = count_around_gemm(padded_once, e, dim, hidden, n)
    r, r16 = n + 15 * e, -(-(n + 15 * e) // 16) * 16  # padded rows, and rounded up to 16

    # One padding of K-wide rows feeding an M-wide product: forward a zero buffer and its
    # index copy (R x K each), the gather (n x M); backward the gather's scatter into zeros
    # (R x M twice) and the index copy's gradient (n x K); plus 3 n-long row indices.
    def pad(rows: int, k: int, m: int) -> int:
        return 2 * rows * k + n * m + 2 * rows * m + n * k + 3 * n

    layout = ("new_zeros", "index_copy", "index", "index_put", "index_select")
    assert sum(old[op] for op in layout) == 2 * pad(r, dim, hidden) + pad(r, hidden, dim)
    assert sum(new[op] for op in layout) == pad(r16, dim, dim)
    assert sum(old[op] for op in layout) == 3_824_640
    assert sum(new[op] for op in layout) == 1_707_008
    assert sum(old.values()) == 4_754_674 and sum(new.values()) == 2_743_387
    # The activation (silu and its backward) runs on the padding rows too.
    assert new["silu"] == new["silu_backward"] == r16 * hidden
    assert old["silu"] == old["silu_backward"] == n * hidden


def test_dispatch_into_padded_layout_allocates_fewer_elements(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Dispatch + float8 SwiGLU + combine, forward and backward, outside the GEMMs, at the debug
    expert shape (8 experts of 256 x 128, 512 tokens x top-2): the per-projection path against
    the padded dispatch, op by op (docs/float8.md has the Qwen3-30B-A3B row)."""
    from torchtitan.models.common.moe import MoEArgs

    def count(dispatch: Callable[..., torch.Tensor]) -> collections.Counter[str]:
        torch.manual_seed(0)
        layer = MoE(256, MoEArgs(num_experts=8, top_k=2, expert_dim=128))
        fg.apply_float8_experts(layer, emulate=True, device_type="cpu")
        flat = torch.randn(512, 256, requires_grad=True)
        idx = torch.randint(0, 8, (512, 2))
        w = torch.rand(512, 2, requires_grad=True)
        mode = _Allocated()
        with mode:
            dispatch(layer, flat, idx, w, torch.full((8,), 128)).sum().backward()
        return mode.elements

    with _gemm_muted(monkeypatch):
        old, new = count(_old_dispatch), count(MoE.dispatch_and_combine)
    assert (sum(old.values()), sum(new.values())) == (6_596_858, 3_315_171)
    # The zero buffers: three paddings' forward and backward, against the combine's extra row
    # and the padded slot weights.
    assert (old["new_zeros"], new["new_zeros"]) == (1_449_984, 265_088)


def saved_for_backward(fwd: Forward, e: int, dim: int, hidden: int, rows: int) -> int:
    """Elements the float8 SwiGLU's forward keeps for its backward (each storage once, the
    weights not counted)."""
    ex = _experts(e, dim, hidden)
    counts = torch.full((e,), rows // e)
    x = torch.randn(rows, dim, requires_grad=True)
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter):
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes() // t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fwd(ex, x, counts)
    return sum(kept.values())


def test_padding_once_keeps_less_for_the_backward() -> None:
    """The w1 and w3 GEMMs keep one padded copy of the rows, not one each, and the activation
    keeps its padded inputs instead of gathered copies (debug expert shape, 1,024 rows)."""
    old = saved_for_backward(per_projection, 8, 256, 128, 1024)
    new = saved_for_backward(padded_once, 8, 256, 128, 1024)
    assert (old, new) == (1_521_688, 1_147_912)


@pytest.mark.parametrize("shape", [(2, 16, 8), (4, 8 * 512, 128), (3, 7, 5)])
def test_slot_share_equals_one_hot_mean(shape: tuple[int, int, int]) -> None:
    """The auxiliary loss's per-sequence slot shares: the scatter-add count over the slots
    equals the mean of the one-hot rows bitwise (fp32), without the ``[B, n, E]`` tensor."""
    b, n, e = shape
    idx = torch.randint(0, e, (b, n))
    share = _slot_share(idx, e)
    assert share.dtype == torch.float32 and share.shape == (b, e)
    assert torch.equal(share, F.one_hot(idx, e).float().mean(1))
    assert torch.equal(share.sum(-1), torch.ones(b))
