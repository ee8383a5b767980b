"""QLoRA (docs/lora.md, "QLoRA"): the frozen projections that carry adapters are stored in NF4
(torchao's ``NF4Tensor``: 4-bit normal-float codes in blocks of 64 values with double-quantized
block scales, about 0.52 bytes per value) and dequantized to the input's dtype per matmul
(``torchao``'s ``linear_nf4``: bf16 compute under bf16 training, fp32 on CPU tests).

Quantization runs once the base weights are final: after the initial load (Hugging Face or
checkpoint), because checkpoints hold only the adapters and the base is reloaded from its source
on resume. One process only (preflight refuses a parallel layout: the NF4 tensor subclass
has no DTensor sharding here).
"""

from __future__ import annotations

import torch
from torch import nn

from torchtitan.lora.layers import LoRALinear

__all__ = ["nf4_problem", "quantize_base"]

BLOCK = 64


def _scaler_block(numel: int) -> int:
    """The largest scaler block (at most torchao's default, 256) dividing the block count."""
    blocks, size = numel // BLOCK, 256
    while size > 1 and blocks % size:
        size //= 2
    return size


def nf4_problem(shape: tuple[int, ...]) -> str | None:
    """Why a weight of ``shape`` cannot be stored in NF4, or None."""
    numel = 1
    for s in shape:
        numel *= s
    if numel % BLOCK:
        return f"a weight of shape {list(shape)} has {numel} values, not a multiple of {BLOCK}"
    return None


@torch.no_grad()
def quantize_base(parts: list[nn.Module], dtype: torch.dtype = torch.bfloat16) -> tuple[int, int]:
    """Replace every adapted projection's frozen weight with its NF4 form (from ``dtype``);
    returns (bytes before, bytes after) of those weights."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    before = after = 0
    for part in parts:
        for module in part.modules():
            if not isinstance(module, LoRALinear):
                continue
            w = module.weight
            problem = nf4_problem(tuple(w.shape))
            if problem is not None:
                raise ValueError(f"lora.quantize_base nf4: {problem}")
            nf4 = to_nf4(w.detach().to(dtype), BLOCK, _scaler_block(w.numel()))
            before += w.numel() * w.element_size()
            inner = (nf4.quantized_data, nf4.quantized_scalers, nf4.quantization_factor)
            after += sum(t.numel() * t.element_size() for t in (*inner, nf4.scaler_mean, nf4.nf4))
            module.weight = nn.Parameter(nf4, requires_grad=False)
    return before, after
