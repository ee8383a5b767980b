"""The ModelSpec contract checks the families' unit tests share: a flavor built on the meta
device has exactly ``spec.num_params`` parameters; its parallel plan and blocks come with it."""

from __future__ import annotations

from typing import Any

import torch

from torchtitan.models import MODELS


def built_on_meta(family: str, flavor: str) -> tuple[Any, Any, torch.nn.Module, Any, Any]:
    """(spec, args, model on meta, parallel plan, the plan's blocks of the model), after
    checking the closed-form parameter count against the built model's."""
    spec = MODELS[family]
    args = spec.flavors[flavor]
    with torch.device("meta"):
        model = spec.build(args)
    assert spec.num_params(args) == sum(p.numel() for p in model.parameters())
    plan = spec.parallel_plan(args)
    return spec, args, model, plan, plan.blocks_of(model)
