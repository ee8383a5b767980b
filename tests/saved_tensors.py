"""What autograd saves for backward, in bytes: the estimator's activation terms are checked
against it (docs/planning.md, "Memory estimator")."""

from __future__ import annotations

from collections.abc import Callable

import torch


def saved_bytes(model: torch.nn.Module, run: Callable[[], object]) -> int:
    """Bytes of the distinct storages autograd saves while ``run()`` runs (not the weights,
    not the complex RoPE table)."""
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s._cdata not in params and t.dtype != torch.complex64:
            saved[s._cdata] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(saved.values())
