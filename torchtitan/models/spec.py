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
    state_dict_adapter: Callable[[Any], Any] | None = None
    """Builds, from the model args, the converter between our state dict and Hugging Face's
    (``to_hf``/``from_hf`` on full tensors); None when the family has no Hugging Face format."""
    supports_context_parallel: bool = False
    """The attention can run on a sequence sharded over cp (parallelize applies apply_cp)."""
