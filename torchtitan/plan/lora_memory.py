"""The memory terms of LoRA and QLoRA (docs/lora.md, "Planning"; docs/planning.md): the base is
frozen (stored, no gradients, no optimizer state), the adapters are trained (fp32 weights,
gradients and moments), and under QLoRA the adapted projections are stored in NF4.

The counts come from the model itself: the flavor is built on ``meta`` and the adapters applied
(``lora/apply.py``), once per shape and setting. A rank holds the same share of the adapters and
the adapted weights as of all parameters (FSDP, TP and PP split them alike, to within a block).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchtitan.config.job_config import Lora
from torchtitan.lora.apply import apply_lora, with_targets
from torchtitan.lora.layers import is_adapter_name
from torchtitan.models import MODELS

__all__ = ["NF4_BYTES", "LoraCounts", "lora_counts"]

NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)
"""Bytes per NF4 element: a 4-bit code, one 8-bit scale per 64 values, one fp32 per 256 scales."""


@dataclass(frozen=True)
class LoraCounts:
    adapters: int
    """Adapter elements of the whole model."""
    adapted: int
    """Elements of the frozen weights that carry adapters (quantized under QLoRA)."""
    total: int
    """Base parameter elements of the whole model."""


_CACHE: dict[tuple, LoraCounts] = {}


def lora_counts(model_name: str, args: object, lora: Lora) -> LoraCounts:
    """The counts for ``args`` (a flavor's shape) with ``lora``'s targets and rank (cached)."""
    lora = with_targets(lora, MODELS[model_name])
    key = (model_name, repr(args), tuple(lora.target_modules), lora.rank)
    if key not in _CACHE:
        _CACHE[key] = _counts(model_name, args, lora)
    return _CACHE[key]


def _counts(model_name: str, args: object, lora: Lora) -> LoraCounts:
    with torch.device("meta"):
        model = MODELS[model_name].build(args)
    adapted_modules = apply_lora(model, lora)
    adapters = sum(p.numel() for n, p in model.named_parameters() if is_adapter_name(n))
    total = sum(p.numel() for n, p in model.named_parameters() if not is_adapter_name(n))
    adapted = 0
    for name in adapted_modules:
        module = model.get_submodule(name)
        adapted += sum(
            p.numel() for n, p in module.named_parameters(recurse=False) if not is_adapter_name(n)
        )
    return LoraCounts(adapters, adapted, total)
