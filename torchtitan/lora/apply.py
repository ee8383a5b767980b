"""Putting adapters on a built model (docs/lora.md; docs/architecture.md, section 3): after the
model is built on ``meta`` and before ``parallelize``, every module whose name matches
``lora.target_modules`` is swapped for its adapter module (:mod:`torchtitan.lora.layers`), the
base is frozen, and after materialization the adapters are initialized the way PEFT does
(``A`` kaiming-uniform with ``a = sqrt(5)``, i.e. uniform in ``+-1/sqrt(in)``; ``B`` zeros),
each from a generator seeded by its name, so every layout draws the same values.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from torchtitan.config.job_config import Lora
from torchtitan.distributed.init_weights import param_seed
from torchtitan.lora.layers import (
    LoRAExperts,
    LoRALinear,
    adapt_experts,
    is_adapter_name,
    lora_scaling,
)
from torchtitan.models.common.moe_experts import StackedExperts

__all__ = [
    "adapter_names",
    "apply_lora",
    "base_init_only",
    "freeze_base",
    "init_adapters",
    "matches",
    "with_targets",
]

_WRAPPERS = ("_orig_mod.", "_checkpoint_wrapped_module.")


def matches(fqn: str, patterns: list[str]) -> bool:
    """Whether module ``fqn`` matches a pattern, as a whole or as a dotted suffix."""
    return any(fnmatch.fnmatchcase(fqn, p) or fnmatch.fnmatchcase(fqn, "*." + p) for p in patterns)


def with_targets(cfg: Lora, spec: Any, args: Any) -> Lora:
    """``cfg`` with its targets resolved: empty ``target_modules`` takes the family's
    (``FamilySpec.lora_targets``; a spec without them adapts nothing, which is refused); with
    ``adapter_targets = "from_adapter"`` the modules the PEFT folder ``adapter_path`` adapts
    (``args``: the model shape, whose module names are matched)."""
    if cfg.adapter_targets == "from_adapter" and cfg.adapter_path:
        from torchtitan.lora.peft_io import targets_from_adapter

        with torch.device("meta"):
            model = spec.build(args)
        adapter = spec.state_dict_adapter(args)
        targets = targets_from_adapter(Path(cfg.adapter_path), adapter, model)
        return dataclasses.replace(cfg, target_modules=targets)
    if cfg.target_modules:
        return cfg
    return dataclasses.replace(cfg, target_modules=list(getattr(spec, "lora_targets", ())))


def apply_lora(model: nn.Module, cfg: Lora) -> list[str]:
    """Swap every matching module of ``model`` for its adapter module and freeze the rest;
    returns the adapted module names. Raises ``ValueError`` when a match cannot take an adapter
    or nothing matches."""
    scaling = lora_scaling(cfg.rank, cfg.alpha, cfg.use_rslora)
    adapted: list[str] = []
    for fqn, module in list(model.named_modules()):
        if not fqn or not matches(fqn, cfg.target_modules):
            continue
        if type(module) is nn.Linear:
            new: nn.Module = LoRALinear(module, cfg.rank, scaling, cfg.dropout)
        elif isinstance(module, StackedExperts) and not isinstance(module, LoRAExperts):
            # Every family's stacked experts through their declared ``project`` hook.
            new = adapt_experts(module, module.projections, cfg.rank, scaling, cfg.dropout)
        else:
            raise ValueError(
                f"{fqn} is a {type(module).__name__}; adapters wrap "
                "nn.Linear projections and grouped MoE experts"
            )
        parent, _, child = fqn.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
        adapted.append(fqn)
    if not adapted:
        raise ValueError(f"{cfg.target_modules} match no module of the model")
    freeze_base(model)
    return adapted


def freeze_base(model: nn.Module) -> None:
    """Only adapter parameters train (call again after ``parallelize``: torch's TP styles make
    new parameters with ``requires_grad=True``)."""
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter_name(name))


def adapter_names(model: nn.Module) -> list[str]:
    return [n for n, _ in model.named_parameters() if is_adapter_name(n)]


def _clean(fqn: str) -> str:
    for w in _WRAPPERS:
        fqn = fqn.replace(w, "")
    return fqn


@contextlib.contextmanager
def base_init_only(model: nn.Module) -> Iterator[None]:
    """Hide the adapter parameters (the model's own init plan has no rule for them)."""
    hidden: list[tuple[nn.Module, str, nn.Parameter]] = []
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and is_adapter_name(name):
                hidden.append((module, name, module._parameters.pop(name)))  # type: ignore[arg-type]
    try:
        yield
    finally:
        for module, name, p in hidden:
            module._parameters[name] = p


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int) -> None:
    """PEFT's initialization, layout-independent: ``lora_A*`` uniform in ``+-1/sqrt(in)``
    (full tensor from the name's generator, this rank's shard sliced out), ``lora_B*`` zeros."""
    for fqn, p in model.named_parameters():
        if not is_adapter_name(fqn):
            continue
        key, local = _clean(fqn), p.to_local() if isinstance(p, DTensor) else p
        full = torch.zeros(p.shape, dtype=torch.float32, device=local.device)
        if key.rsplit(".", 1)[-1].startswith("lora_A"):
            fan_in = p.shape[-1] if p.dim() == 2 else p.shape[-2]  # [r, in] or [E, in, r]
            gen = torch.Generator(device=local.device).manual_seed(param_seed(seed, key))
            bound = 1.0 / math.sqrt(fan_in)
            full.uniform_(-bound, bound, generator=gen)
        if isinstance(p, DTensor):
            shape, offset = compute_local_shape_and_global_offset(
                p.shape, p.device_mesh, p.placements
            )
            full = full[tuple(slice(o, o + s) for o, s in zip(offset, shape))]
        local.copy_(full)
