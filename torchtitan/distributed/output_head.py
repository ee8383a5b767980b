"""Deferring a model's vocabulary projection to the loss (chunked cross-entropy, docs/memory.md).

With ``training.loss_chunk_size`` > 0 the model's output projection (the module its parallel
plan names as ``TensorParallelPlan.output``, a bias-free ``nn.Linear``) keeps its weight, and so
its parameter name, FSDP unit, TP sharding and checkpoint entry, but its forward returns its
input: the model then returns the final-normed hidden states ``[B, S, dim]`` and the loss
(``loss/chunked.py``) multiplies them by the weight a chunk of tokens at a time, so
the full ``[tokens, vocab]`` logits never exist.
"""

from __future__ import annotations

import torch
from torch import nn

from torchtitan.distributed.model_plan import submodule_or_none


class DeferredLinear(nn.Linear):
    """An ``nn.Linear`` whose forward is the identity: the loss applies ``weight`` itself."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return input


def defer_output(model: nn.Module, path: str | None) -> nn.Module | None:
    """Make the output projection at ``path`` a :class:`DeferredLinear` in place (its
    parameters untouched); returns it, or None where a pipeline stage has no output."""
    if path is None:
        raise ValueError("the model's parallel plan names no output projection to defer")
    module = submodule_or_none(model, path)
    if module is None or isinstance(module, DeferredLinear):
        return module
    if type(module) is not nn.Linear or module.bias is not None:
        raise TypeError(
            f"chunked cross-entropy needs the output projection {path!r} to be a bias-free "
            f"nn.Linear, found {type(module).__name__}"
        )
    module.__class__ = DeferredLinear
    return module


def deferred_output(parts: list[nn.Module], path: str | None) -> DeferredLinear | None:
    """The deferred output projection among this rank's model parts (None on pipeline ranks
    without the last stage)."""
    if path is None:
        return None
    for part in parts:
        module = submodule_or_none(part, path)
        if isinstance(module, DeferredLinear):
            return module
    return None
