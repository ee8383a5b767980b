"""Optimizer construction (AdamW/Adam with a chosen kernel implementation)."""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from torchtitan.tools.logging import logger


def build_optimizer(
    model_parts: list[nn.Module],
    name: Literal["AdamW", "Adam"],
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    implementation: Literal["fused", "foreach", "for-loop"],
) -> torch.optim.Optimizer:
    """One optimizer over the parameters of every model part (pipeline stages on this rank).

    ``fused`` runs one kernel per parameter group on CUDA and CPU; where the parameters cannot
    use it (e.g. a mix of plain tensors and DTensors), ``foreach`` is used and the reason logged.
    """
    params = [p for part in model_parts for p in part.parameters() if p.requires_grad]
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
