"""Float8 routed experts: the rowwise-scaled float8 grouped GEMM, forward and backward
(docs/float8.md, "Float8 experts"; docs/moe.md).

:func:`float8_grouped_mm` multiplies rows sorted by expert (``counts[e]`` rows for expert ``e``)
by stacked expert weights ``[E, K, N]``, with every operand of the three GEMMs rounded to
``float8_e4m3fn`` under power-of-2 scales (torchao's rowwise MoE recipe):

* forward ``out = x @ w[e]``: ``x`` one scale per row (over ``K``), ``w`` one per expert and
  output column (over ``K``);
* input gradient ``dx = dout @ w[e]^T``: ``dout`` one per row (over ``N``), ``w`` one per
  expert and input row (over ``N``);
* weight gradient ``dw[e] = x_e^T @ dout_e``: ``x`` and ``dout`` one scale per expert and
  column, over that expert's rows.

Scales are ``448 / max|values|`` (amax at least 1e-12) rounded down to a power of 2, so scaling
and unscaling are exact and only the float8 cast rounds. Products accumulate in fp32 and the
result takes the input's dtype.

Each expert's rows are first padded to a multiple of 16 (the float8 grouped GEMM's alignment)
by an index copy into a buffer of a fixed size, ``rows + E * 15`` (no host synchronisation:
the padded offsets are computed on the device), and the output rows are gathered back. A
caller that chains GEMMs over the same rows (the SwiGLU experts) pads once
(:func:`pad_groups`, :class:`PaddedGroups`) and multiplies in the padded layout
(:func:`float8_grouped_mm_padded`): the padding rows are zero, so they change no scale.

Two implementations of the same numbers:

* CUDA with float8 tensor cores (capability >= 8.9): torchao's
  ``_to_fp8_rowwise_then_scaled_grouped_mm`` (its Triton quantisation kernels and
  ``torch._scaled_grouped_mm``);
* everywhere else, and with ``emulate``: :class:`_EmulatedFloat8GroupedMM`, which quantises
  and dequantises with the same scales in PyTorch and multiplies in fp32 (no speed-up): the
  numerics the CPU test suite checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torchtitan.tools.logging import logger

__all__ = [
    "ALIGN",
    "PaddedGroups",
    "apply_float8_experts",
    "float8_grouped_mm",
    "float8_grouped_mm_padded",
    "pad_groups",
    "padded_layout",
    "quantize",
]

ALIGN = 16
"""Rows per expert group are padded to a multiple of this (the float8 grouped GEMM's rule)."""

_F8 = torch.float8_e4m3fn
_EPS = 1e-12


def quantize(x: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``x`` rounded to float8 e4m3 and back to fp32, the scale) for the given ``amax``
    (broadcastable to ``x``): ``scale = 448 / amax`` (computed in fp64, as torchao), rounded
    down to a power of 2; the values saturate at +-448."""
    fmax = torch.finfo(_F8).max
    scale = (fmax / amax.double().clamp(min=_EPS)).float()
    scale = torch.exp2(torch.floor(torch.log2(scale)))
    q = (x.float() * scale).clamp(-fmax, fmax).to(_F8)
    return q.float() / scale, scale


def _amax(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x.detach().abs().amax(dim=dim, keepdim=True).float()


def _group_amax(x: torch.Tensor, group: torch.Tensor, groups: int) -> torch.Tensor:
    """Per group (``group[i]`` of row ``i``) and column, the max ``|x|``: ``[groups, cols]``."""
    out = x.new_zeros(groups, x.shape[1], dtype=torch.float32)
    index = group[:, None].expand(-1, x.shape[1])
    return out.scatter_reduce(0, index, x.detach().abs().float(), "amax")


def _gmm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm`` in fp32 (2-D x 3-D: rows by group; 2-D x 2-D: the shared
    dimension by group), a loop over the groups where the device has no fp32 kernel."""
    try:
        return torch._grouped_mm(a, b, offs=offs)
    except (RuntimeError, NotImplementedError):
        ends = offs.tolist()  # the fallback only: one host sync
        starts = [0, *ends[:-1]]
        if b.dim() == 3:
            out = a.new_zeros(a.shape[0], b.shape[-1])
            for e, (s, t) in enumerate(zip(starts, ends)):
                out[s:t] = a[s:t] @ b[e]
            return out
        return torch.stack([a[:, s:t] @ b[s:t] for s, t in zip(starts, ends)])


class _EmulatedFloat8GroupedMM(torch.autograd.Function):
    """``x [P, K] @ w[e] [K, N]`` per group of rows (``offs``: the groups' end rows), every
    GEMM operand rounded as the float8 kernels round it (module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        xq, _ = quantize(x, _amax(x, -1))
        wq, _ = quantize(w, _amax(w, 1))
        ctx.save_for_backward(x, w, offs)
        return _gmm(xq, wq, offs).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, Any, None]:
        x, w, offs = ctx.saved_tensors
        dx = dw = None
        if ctx.needs_input_grad[0]:
            gq, _ = quantize(grad, _amax(grad, -1))
            wq, _ = quantize(w, _amax(w, 2))
            dx = _gmm(gq, wq.transpose(-2, -1), offs).to(x.dtype)
        if ctx.needs_input_grad[1]:
            groups = w.shape[0]
            rows = torch.arange(x.shape[0], device=x.device)
            # Rows past the last group are padding (zero): counted in the last group.
            group = torch.searchsorted(offs, rows.to(offs.dtype), right=True).clamp(max=groups - 1)
            gq, _ = quantize(grad, _group_amax(grad, group, groups)[group])
            xq, _ = quantize(x, _group_amax(x, group, groups)[group])
            dw = _gmm(xq.t(), gq, offs).to(w.dtype)
        return dx, dw, None


def pad_groups(
    x: torch.Tensor, counts: torch.Tensor, align: int = ALIGN, whole: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(``x``'s rows in a zero buffer of ``rows + E * (align - 1)`` rows where each expert's
    group starts at a multiple of ``align``, the padded groups' end offsets (int32), the buffer
    row of each row of ``x``). Differentiable; no host synchronisation.

    ``whole``: the buffer is rounded up to a multiple of ``align`` rows and the last group
    extends to its end, so every row lies in a group (a GEMM leaves rows past the last offset
    unwritten: a chain of GEMMs in this layout must not read them)."""
    size, offs, where = padded_layout(counts, x.shape[0], align, whole)
    buffer = x.new_zeros(size, x.shape[1]).index_copy(0, where, x)
    return buffer, offs, where


def padded_layout(
    counts: torch.Tensor, rows: int, align: int = ALIGN, whole: bool = False
) -> tuple[int, torch.Tensor, torch.Tensor]:
    """:func:`pad_groups`'s layout for ``rows`` rows sorted by expert: (the buffer's rows, the
    padded groups' end offsets, the buffer row of each row)."""
    e = counts.numel()
    padded = (counts + align - 1) // align * align
    starts = torch.cumsum(counts, 0) - counts
    padded_starts = torch.cumsum(padded, 0) - padded
    expert = torch.repeat_interleave(
        torch.arange(e, device=counts.device), counts, output_size=rows
    )
    where = padded_starts[expert] + torch.arange(rows, device=counts.device) - starts[expert]
    size = rows + e * (align - 1)
    if whole:
        size = -(-size // align) * align
    offs = torch.cumsum(padded, 0, dtype=torch.int32)
    if whole:
        offs = torch.cat([offs[:-1], offs.new_full((1,), size)])
    return size, offs, where


@dataclass(frozen=True)
class PaddedGroups:
    """Rows in the padded layout of :func:`pad_groups`: ``counts`` the real rows per expert,
    ``offs`` the padded groups' end offsets (int32), ``where`` the buffer row of each real row
    (``buffer[where]`` are the rows sorted by expert)."""

    counts: torch.Tensor
    offs: torch.Tensor
    where: torch.Tensor


def float8_grouped_mm(
    x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, emulate: bool
) -> torch.Tensor:
    """Rows of ``x`` (sorted by expert, ``counts[e]`` for expert ``e``) times ``w[e]``
    (``[E, K, N]``), the GEMMs in float8 with rowwise scales (module docstring); ``emulate``
    or a device without float8 GEMMs: the emulation."""
    buffer, offs, where = pad_groups(x, counts)
    return float8_grouped_mm_padded(buffer, w, offs, emulate)[where]


def float8_grouped_mm_padded(
    buffer: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, emulate: bool
) -> torch.Tensor:
    """:func:`float8_grouped_mm` on rows already in the padded layout (``buffer`` and ``offs``
    from :func:`pad_groups`): the product in the same layout, zero on the padding rows."""
    if emulate or buffer.device.type != "cuda":
        return _EmulatedFloat8GroupedMM.apply(buffer, w, offs)
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

    # torchao wants the right operand column-major per expert (strides (K*N, 1, K)).
    w_cm = w.transpose(-2, -1).contiguous().transpose(-2, -1)
    return _to_fp8_rowwise_then_scaled_grouped_mm(
        buffer, w_cm, offs, out_dtype=buffer.dtype, pad_token_groups_for_grouped_mm=False
    )


def apply_float8_experts(model: nn.Module, emulate: bool, device_type: str) -> list[str]:
    """Set every stacked-experts module of ``model`` (a module with ``projections`` and a
    ``float8`` mode: ``models/common/moe_experts.py: StackedExperts``) to run its projections
    in float8: ``native`` on CUDA (the preflight has checked the capability), ``emulated`` with
    ``emulate`` or elsewhere. Returns the modules' names."""
    mode = "emulated" if emulate or device_type != "cuda" else "native"
    names = []
    for name, module in model.named_modules():
        if hasattr(module, "projections") and hasattr(module, "float8"):
            module.float8 = mode
            names.append(name)
    if names:
        logger.info(f"float8 experts ({mode}): {len(names)} expert stacks")
    return names
