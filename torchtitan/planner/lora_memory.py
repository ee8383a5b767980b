"""The memory and step-time terms of LoRA and QLoRA (docs/lora.md, "Planning"; docs/planning.md):
the base is frozen (stored, no gradients, no optimizer state), the adapters are trained (fp32
weights, gradients and moments), and under QLoRA the adapted projections are stored in NF4.

Step time (``planner/cost_model.py``), per token: a frozen matmul still needs its input gradient
but not its weight gradient, so the backward of the base is 1x its forward instead of 2x
(``6 N`` becomes ``4 N``); the adapters cost their own ``6 n``. FSDP reduces the adapter
gradients only and gathers the NF4 bytes of a QLoRA base; the optimizer steps the adapters only.
Under QLoRA every matmul dequantizes its weight first (forward, backward and recompute, each
microbatch): ``DEQUANT_BYTES`` of memory traffic per value.

The counts come from the model itself: the flavor is built on ``meta`` and the adapters applied
(``lora/apply.py``), once per shape and setting. A rank holds the same share of the adapters and
the adapted weights as of all parameters (FSDP, TP and PP split them alike, to within a block).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from torchtitan.config.job_config import JobConfig, Lora
from torchtitan.lora.apply import apply_lora, with_targets
from torchtitan.lora.layers import is_adapter_name
from torchtitan.models import MODELS
from torchtitan.models.common.vision.flops import tower_flops_per_token

__all__ = [
    "DEQUANT_BYTES",
    "NF4_BYTES",
    "LoraCounts",
    "LoraShares",
    "lora_counts",
    "lora_shares",
    "training_flops_per_token",
]

NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)
"""Bytes per NF4 element: a 4-bit code, one 8-bit scale per 64 values, one fp32 per 256 scales."""

DEQUANT_BYTES = 48.0
"""Memory traffic of dequantizing one NF4 value to bf16 (torchao's ``NF4Tensor.to``, several
elementwise passes): measured as 12 bf16 copies (4 bytes a value each) of a 4096 x 4096 weight
on the 2-core CPU (383 ms vs 31.6 ms, one thread); not measured on a GPU."""


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
    lora = with_targets(lora, MODELS[model_name], args)
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


@dataclass(frozen=True)
class LoraShares:
    """What the step-time model needs of a LoRA run: the counts and whether the base is NF4.
    A rank's share of the adapters (or adapted weights) is that of all its parameters."""

    counts: LoraCounts
    nf4: bool

    def adapters_of(self, params: float) -> float:
        return params * self.counts.adapters / self.counts.total

    def adapted_of(self, params: float) -> float:
        return params * self.counts.adapted / self.counts.total

    def flops_delta_per_token(self, frozen_matmul_params: float) -> float:
        """No weight-gradient matmul for the frozen base (``-2 N``), the adapters' ``6 n``."""
        return 6 * self.counts.adapters - 2 * frozen_matmul_params

    def gather_bytes(self, params: float, dtype_bytes: int) -> float:
        """What FSDP all-gathers for ``params`` base values: the NF4 bytes of the adapted
        weights under QLoRA, and the adapters (cast to the compute dtype)."""
        adapted = self.adapted_of(params)
        stored = NF4_BYTES if self.nf4 else dtype_bytes
        adapters = self.adapters_of(params)
        return (params - adapted + adapters) * dtype_bytes + adapted * stored

    def dequant_s(self, params: float, passes: float, gbps: float) -> float:
        """Dequantizing this rank's NF4 weights ``passes`` times at ``gbps`` GB/s."""
        return self.adapted_of(params) * DEQUANT_BYTES * passes / (gbps * 1e9) if self.nf4 else 0.0


def lora_shares(cfg: JobConfig, args: object) -> LoraShares | None:
    """The LoRA terms of ``cfg`` (its levers applied), or None without adapters."""
    if not cfg.lora.enable:
        return None
    counts = lora_counts(cfg.model.name, args, cfg.lora)
    return LoraShares(counts, cfg.lora.quantize_base == "nf4")


def training_flops_per_token(cfg: JobConfig, args: Any) -> int:
    """FLOPs one trained token costs, forward and backward, for ``cfg``'s model and adapters: the
    one count behind MFU in the log and the JSONL, ``benchmarks/throughput.py`` and the planner's
    step time (docs/observability.md, "What MFU counts").

    The family gives the full-training count (``ModelSpec.flops_per_token``: ``6 N`` for the
    active matmul parameters, plus attention, plus its MTP modules where it has them). A frozen
    base computes no weight gradients: ``6 N`` becomes ``4 N``, and the adapters add their own
    ``6 n``. Work that is not a model matmul is left out, as MFU conventionally does: QLoRA's
    dequantization, the optimizer (AdamW, Muon's Newton-Schulz) and activation recompute lower
    MFU instead of adding to its numerator. A vision tower counts per patch of the
    ``training.image_tokens_per_sample`` (``models/common/vision/flops.py``)."""
    t = cfg.training
    flops: float = MODELS[cfg.model.name].flops_per_token(args, t.seq_len)
    vision = getattr(args, "vision", None)  # a tower: per patch (models/common/vision/flops.py)
    if vision is not None:
        flops += tower_flops_per_token(vision, t.image_tokens_per_sample, t.seq_len)
    lora = lora_shares(cfg, args)
    if lora is None:
        return int(flops)
    frozen = args.num_params(exclude_embedding=True, active=True)
    return int(flops + lora.flops_delta_per_token(frozen))
