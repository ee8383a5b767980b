"""Optimizer construction (AdamW/Adam with a chosen kernel implementation)."""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from torchtitan.optim.low_precision_adamw import LowPrecisionAdamW
from torchtitan.tools.logging import logger


def build_optimizer(
    model_parts: list[nn.Module],
    name: Literal["AdamW", "Adam"],
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    implementation: Literal["fused", "foreach", "for-loop"],
    moments_dtype: Literal["float32", "bfloat16"] = "float32",
    seed: int = 0,
) -> torch.optim.Optimizer:
    """One optimizer over the parameters of every model part (pipeline stages on this rank).

    ``fused`` runs one kernel per parameter group on CUDA and CPU; where the parameters cannot
    use it (e.g. a mix of plain tensors and DTensors), ``foreach`` is used and the reason logged.
    """
    params = [p for part in model_parts for p in part.parameters() if p.requires_grad]
    if moments_dtype == "bfloat16" or any(p.dtype == torch.bfloat16 for p in params):
        # bf16 moments or bf16 master weights: rounded stochastically (docs/memory.md).
        logger.info(
            f"optimizer: {name} with {moments_dtype} moments, stochastic rounding of bf16 "
            f"stores (a per-parameter loop: implementation={implementation} does not apply)"
        )
        return LowPrecisionAdamW(
            params,
            moments_dtype=getattr(torch, moments_dtype),
            decoupled=name == "AdamW",
            seed=seed,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
        )
    cls = torch.optim.AdamW if name == "AdamW" else torch.optim.Adam
    kwargs = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    impl = implementation
    if impl == "fused":
        kinds = {type(p.data) for p in params}
        if len(kinds) > 1:
            logger.info(
                "optimizer: parameters mix %s; using foreach instead of fused",
                sorted(k.__name__ for k in kinds),
            )
            impl = "foreach"
    if impl == "fused":
        return cls(params, fused=True, **kwargs)  # type: ignore[arg-type]
    if impl == "foreach":
        return cls(params, foreach=True, **kwargs)  # type: ignore[arg-type]
    return cls(params, foreach=False, fused=False, **kwargs)  # type: ignore[arg-type]
