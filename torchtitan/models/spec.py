"""What the trainer needs to know about a model family."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn


@dataclass(frozen=True)
class ModelSpec:
    name: str
    flavors: dict[str, Any]
    """flavor name -> model args dataclass."""
    model_cls: Callable[[Any], nn.Module]
    """Builds the model from its args (called under the meta device)."""
    parallelize: Callable[..., nn.Module]
    """The per-model plan: (model, parallel_dims, job_config, device) -> model with TP/CP/AC/compile/FSDP applied."""
