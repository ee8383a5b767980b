"""The experts of the shared Mixture-of-Experts layer (docs/moe.md): routed SwiGLUs held as stacked
``[E, ...]`` weights and run as one grouped GEMM (``torch._grouped_mm``) where the device and dtype
support it (probed once), an exact per-expert loop elsewhere; the shared experts as one SwiGLU.
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan.distributed import float8_grouped
from torchtitan.distributed.expert_parallel import scale_grad
from torchtitan.distributed.float8_grouped import (
    PaddedGroups,
    float8_grouped_mm,
    float8_grouped_mm_padded,
)
from torchtitan.models.common.feed_forward import FeedForward

__all__ = [
    "Experts",
    "SharedExpert",
    "StackedExperts",
    "compute_dtype",
    "expert_matmul",
    "grouped_mm_supported",
    "grouped_mm_traceable",
    "local_linear",
    "local_weight",
]


@torch.compiler.assume_constant_result  # compile calls it once, eagerly, and keeps the answer
def grouped_mm_supported(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs forward and backward here and matches a loop (probed
    once per device type and dtype: support differs across torch versions and devices)."""
    return _probe_grouped_mm(device_type, dtype)


@functools.cache
def _probe_grouped_mm(device_type: str, dtype: torch.dtype) -> bool:
    # In a thread of its own: the first call may come from inside an activation-checkpointed
    # forward, whose saved-tensor hooks and dispatch modes (thread-local) must not see the
    # probe's own forward and backward (its backward would trigger the recomputation).
    # A new thread starts on accelerator 0: give it the caller's device (no context on GPU 0).
    device = torch.device(device_type)
    if device.type == getattr(torch.accelerator.current_accelerator(), "type", None):
        device = torch.device(device.type, torch.accelerator.current_device_index())
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(_run_probe, device, dtype).result()


def _run_probe(device: torch.device, dtype: torch.dtype) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device.index is not None:
        torch.accelerator.set_device_index(device.index)
    try:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(24, 16, generator=gen).to(device, dtype).requires_grad_()
        w = torch.randn(3, 16, 16, generator=gen).to(device, dtype).requires_grad_()
        offs = torch.tensor([8, 8, 24], dtype=torch.int32, device=device)
        y = torch._grouped_mm(x, w, offs=offs)
        y.backward(torch.ones_like(y))
        ref = torch.cat([x[:8] @ w[0], x[8:] @ w[2]])
        return bool(torch.allclose(y, ref, rtol=1e-2, atol=1e-2)) and w.grad is not None
    except (RuntimeError, NotImplementedError):
        return False


@torch.compiler.assume_constant_result
def grouped_mm_traceable(dtype: torch.dtype) -> bool:
    """Whether torch.compile can trace ``torch._grouped_mm`` in ``dtype``: its meta kernel (the
    shape function compile runs) accepts only bf16 on torch 2.13, although the CPU kernel runs
    fp32 too."""
    return _probe_meta(dtype)


@functools.cache
def _probe_meta(dtype: torch.dtype) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        x, w = (
            torch.empty(24, 16, device="meta", dtype=dtype),
            torch.empty(3, 16, 16, device="meta", dtype=dtype),
        )
        torch._grouped_mm(x, w, offs=torch.empty(3, device="meta", dtype=torch.int32))
        return True
    except (RuntimeError, NotImplementedError):
        return False


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the experts multiply in: autocast's where it is on for ``x``'s device (the
    trainer's mixed precision without FSDP, docs/memory.md), else ``x``'s. ``torch._grouped_mm``
    has no autocast rule, so the experts cast as autocast would."""
    device = x.device.type  # autocast refuses to be asked about some types (meta)
    if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


def expert_matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    counts: torch.Tensor | PaddedGroups,
    grouped: bool,
    float8: str = "off",
):
    """Rows of ``x`` (sorted by expert, ``counts[e]`` rows for expert ``e``) times ``w[e]``, in
    :func:`compute_dtype` (under autocast both are cast to its dtype first); ``float8``
    ``native`` / ``emulated``: the rowwise float8 grouped GEMM (``distributed/float8_grouped.py``).
    ``counts`` a :class:`PaddedGroups`: ``x`` is already in the float8 GEMM's padded layout (and
    so is the product)."""
    dtype = compute_dtype(x)
    x, w = x.to(dtype), w.to(dtype)
    if isinstance(counts, PaddedGroups):
        if float8 == "off":
            raise ValueError("padded expert rows are for the float8 grouped GEMM only")
        return float8_grouped_mm_padded(x, w, counts.offs, emulate=float8 == "emulated")
    if float8 != "off":
        return float8_grouped_mm(x, w, counts, emulate=float8 == "emulated")
    if grouped:
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        return torch._grouped_mm(x, w, offs=offs)
    parts = torch.split(x, counts.tolist())  # the fallback: one host sync per call
    return torch.cat([p @ w[e] for e, p in enumerate(parts)])


class StackedExperts(nn.Module):
    """The protocol of routed experts held as stacked weights (docs/moe.md; docs/lora.md): every
    weight named in ``projections`` is ``[E, in, out]`` and multiplies its expert's rows through
    :meth:`project`, the one hook a wrapper (LoRA's per-expert adapters) overrides; biases and
    activations stay in the family's ``forward``. Expert parallel shards every direct parameter on
    dimension 0 and sets ``grad_scale``."""

    param_kind = "experts"  # optimizer kind: Muon treats each expert's matrix on its own
    projections: tuple[str, ...] = ()
    use_grouped_mm: bool | None
    """None: decided by :func:`grouped_mm_supported`; True/False forces a path."""
    grad_scale: float
    """Gradient factor of expert-parallel (DTensor) weights: 1 / ep."""
    float8: str = "off"
    """``off``, ``native`` or ``emulated``: the projections' GEMMs in float8
    (``distributed/float8_grouped.py: apply_float8_experts``; adapters stay in high precision)."""

    def project(
        self, x: torch.Tensor, name: str, counts: torch.Tensor | PaddedGroups, grouped: bool
    ):
        """Rows of ``x`` (sorted by expert) times their expert's ``name`` matrix; ``counts`` a
        :class:`PaddedGroups`: rows and product in the float8 padded layout."""
        w = local_weight(getattr(self, name), self.grad_scale)
        return expert_matmul(x, w, counts, grouped, self.float8)

    def _grouped(self, x: torch.Tensor) -> bool:
        if self.use_grouped_mm is not None:
            return self.use_grouped_mm
        dtype = compute_dtype(x)
        ws = (getattr(self, n) for n in self.projections)
        return grouped_mm_supported(x.device.type, dtype) and _aligned(dtype, x, *ws)

    def traceable(self, x: torch.Tensor) -> bool:
        """Whether torch.compile can trace the forward on rows like ``x``: the grouped GEMM
        (the loop needs the split sizes on the host) with a meta kernel for the dtype."""
        if self.float8 != "off":  # the emulation multiplies in fp32 (no meta kernel)
            return self.float8 == "native"
        return self._grouped(x) and grouped_mm_traceable(compute_dtype(x))


class Experts(StackedExperts):
    """``E`` SwiGLU experts as stacked weights: ``w1``/``w3`` ``[E, dim, hidden]``, ``w2``
    ``[E, hidden, dim]`` (a token's row times the matrix, no transpose)."""

    projections = ("w1", "w2", "w3")

    def __init__(self, num_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.use_grouped_mm = None
        self.grad_scale = 1.0

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # Under expert parallel the weights are DTensors: this rank's experts are its shard,
        # and their gradients are scaled by 1 / ep (distributed/expert_parallel.py).
        grouped = self._grouped(x)
        if self.float8 != "off":
            return self._forward_padded(x, counts, grouped)
        h = F.silu(self.project(x, "w1", counts, grouped)) * self.project(x, "w3", counts, grouped)
        return self.project(h, "w2", counts, grouped)

    def _forward_padded(self, x: torch.Tensor, counts: torch.Tensor, grouped: bool):
        """The float8 SwiGLU padded once (docs/float8.md, "Copies around the float8 GEMM"): the
        rows go into the GEMMs' padded layout once, ``w1``/``w3``/``w2`` multiply in it and the
        output rows come back once. The padding rows are zero and stay zero (``silu(0) * 0``),
        so every scale and every real row equal the per-projection padding's."""
        # Through the module: benchmarks/moe_profile.py labels ``pad_groups`` there.
        buffer, offs, where = float8_grouped.pad_groups(x, counts, whole=True)
        return self.forward_padded(buffer, PaddedGroups(counts, offs, where), grouped)[where]

    def forward_padded(
        self, x: torch.Tensor, groups: PaddedGroups, grouped: bool | None = None
    ) -> torch.Tensor:
        """The float8 SwiGLU on rows already in the padded layout (``pad_groups(...,
        whole=True)``), the output in the same layout (zero on the padding rows)."""
        if grouped is None:
            grouped = self._grouped(x)
        h = F.silu(self.project(x, "w1", groups, grouped)) * self.project(x, "w3", groups, grouped)
        return self.project(h, "w2", groups, grouped)


def local_weight(w: torch.Tensor, grad_scale: float = 1.0) -> torch.Tensor:
    """A weight's local values: expert-parallel shards (gradient scaled by ``grad_scale``) and
    tensor-parallel replicas (``distributed/replicate_parallel.py``) compute locally."""
    if not isinstance(w, DTensor):
        return w
    local = w.to_local()
    return local if grad_scale == 1.0 else scale_grad(local, grad_scale)


def _aligned(dtype: torch.dtype, x: torch.Tensor, *ws: torch.Tensor) -> bool:
    """grouped_mm needs every row stride (in ``dtype``) to be a multiple of 16 bytes."""
    return all((t.shape[-1] * dtype.itemsize) % 16 == 0 for t in (x, *ws))


class SharedExpert(FeedForward):
    """The shared experts: one dense SwiGLU every token runs, on local weights (the MoE layer's
    parallel plans leave them replicated, ``local_linear``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(local_linear(self.w1, x)) * local_linear(self.w3, x)
        return local_linear(self.w2, h)


def local_linear(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``m(x)`` on local values: a module with ``local_forward`` (an adapter, docs/lora.md)
    runs it, a plain ``nn.Linear`` multiplies by its local weight."""
    fwd = getattr(m, "local_forward", None)
    weight: torch.Tensor = m.weight  # type: ignore[assignment]
    return fwd(x) if callable(fwd) else F.linear(x, local_weight(weight, 1.0))
