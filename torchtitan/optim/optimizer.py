"""Optimizer construction: parameter groups by kind and rule (``param_groups.py``), then AdamW,
Adam or Muon over them (docs/optimizers.md), with a chosen kernel implementation."""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

from torchtitan.config.job_config import Optimizer as OptimizerConfig
from torchtitan.distributed.utils import resolve_dtype
from torchtitan.optim.low_precision_adamw import LowPrecisionAdamW
from torchtitan.optim.muon import Muon
from torchtitan.optim.param_groups import build_param_groups, clean_name, param_kinds
from torchtitan.tools.logging import logger


def named_params(
    model_parts: list[nn.Module], output: str | None, embedding: str | None
) -> list[tuple[str, nn.Parameter, str]]:
    """(full name, parameter, kind) of every trainable parameter of every part."""
    out = []
    for part in model_parts:
        kinds = param_kinds(part, output, embedding)
        for raw, p in part.named_parameters():
            if p.requires_grad:
                name = clean_name(raw)
                out.append((name, p, kinds[name]))
    return out


def _kernel(params: list[torch.Tensor], implementation: str) -> dict[str, bool]:
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
        return {"fused": True}
    if impl == "foreach":
        return {"foreach": True}
    return {"foreach": False, "fused": False}


def build_optimizer(
    model_parts: list[nn.Module],
    o: OptimizerConfig,
    *,
    seed: int = 0,
    device_type: str = "cpu",
    output: str | None = None,
    embedding: str | None = None,
    strict: bool = True,
) -> torch.optim.Optimizer:
    """One optimizer over the parameters of every model part (pipeline stages on this rank),
    one torch param group per distinct (update rule, lr multiplier, weight decay).

    ``fused`` runs one kernel per parameter group on CUDA and CPU; where the parameters cannot
    use it (e.g. a mix of plain tensors and DTensors), ``foreach`` is used and the reason logged.
    """
    named = named_params(model_parts, output, embedding)
    groups = build_param_groups(named, o.groups, o.name, o.lr, o.weight_decay, strict)
    params = [p for _, p, _ in named]
    betas = (o.beta1, o.beta2)
    if o.name == "Muon":
        adam = [p for g in groups if g["algorithm"] == "adamw" for p in g["params"]]
        return Muon(
            groups,
            lr=o.lr,
            betas=betas,
            eps=o.eps,
            weight_decay=o.weight_decay,
            momentum=o.muon_momentum,
            nesterov=o.muon_nesterov,
            ns_steps=o.muon_ns_steps,
            ns_dtype=resolve_dtype(o.muon_ns_dtype, device_type),
            scale=o.muon_update_scale,
            adam_kwargs=_kernel(adam, o.implementation),
        )
    if o.moments_dtype == "bfloat16" or any(p.dtype == torch.bfloat16 for p in params):
        # bf16 moments or bf16 master weights: rounded stochastically (docs/memory.md).
        logger.info(
            f"optimizer: {o.name} with {o.moments_dtype} moments, stochastic rounding of bf16 "
            f"stores (a per-parameter loop: implementation={o.implementation} does not apply)"
        )
        return LowPrecisionAdamW(
            groups,  # type: ignore[arg-type]
            moments_dtype=getattr(torch, o.moments_dtype),
            decoupled=o.name == "AdamW",
            seed=seed,
            lr=o.lr,
            betas=betas,
            eps=o.eps,
            weight_decay=o.weight_decay,
        )
    cls = torch.optim.AdamW if o.name == "AdamW" else torch.optim.Adam
    kwargs: dict[str, Any] = dict(lr=o.lr, betas=betas, eps=o.eps, weight_decay=o.weight_decay)
    return cls(groups, **kwargs, **_kernel(params, o.implementation))  # type: ignore[arg-type]


Name = Literal["AdamW", "Adam", "Muon"]
__all__ = ["build_optimizer", "named_params"]
