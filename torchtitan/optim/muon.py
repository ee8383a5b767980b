"""Muon (orthogonalised momentum) for weight matrices and expert matrices, AdamW for the other
parameter groups, as one ``torch.optim.Optimizer`` (docs/optimizers.md).

A group with ``algorithm = "muon"`` is updated, per parameter ``W`` (``[m, n]``, or a stack
``[E, m, n]`` of expert matrices, each orthogonalised on its own), as

    M <- mu M + (1 - mu) G                      (momentum buffer, one tensor per parameter)
    U <- (1 - mu) G + mu M  if nesterov else M
    O <- NS_k(U)                                (quintic Newton-Schulz, coefficients a, b, c)
    W <- W (1 - lr wd) - lr s(m, n) O

with ``s = 0.2 sqrt(max(m, n))`` (``match_rms_adamw``, Moonlight, Liu et al. 2025, "Muon is
Scalable for LLM Training") or ``s = sqrt(max(1, m / n))`` (``original``, Keller Jordan's
Muon). Groups with ``algorithm = "adamw"`` are stepped by a ``torch.optim.AdamW`` (or Adam)
that shares this optimizer's groups and state, so its fused/foreach kernels apply.

``torch.optim.Muon`` has the same update, but it orthogonalises 2-D tensors only, always in
bf16, on whatever tensor it is given (a DTensor's local shard under FSDP/TP would be
orthogonalised alone, which is wrong); this class adds expert stacks, an fp32 iteration and the
whole-matrix orthogonalisation of sharded parameters (``muon_dist.py``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from torchtitan.optim.muon_dist import CommStats, orthogonalize

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic
NS_EPS = 1e-7


def newton_schulz(
    g: torch.Tensor,
    steps: int,
    dtype: torch.dtype,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = NS_EPS,
) -> torch.Tensor:
    """Approximate ``U V^T`` of each matrix in ``g`` (``[m, n]`` or ``[B, m, n]``), in
    ``dtype``. The 2-D path runs the same operations as ``torch.optim.Muon``."""
    a, b, c = coefficients
    x = g.to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    mm = torch.addmm if x.ndim == 2 else torch.baddbmm
    for _ in range(steps):
        gram = x @ x.mT
        poly = mm(gram, gram, gram, beta=b, alpha=c)
        x = mm(x, poly, x, beta=a)
    return x.mT if tall else x


def update_scale(shape: torch.Size, convention: str) -> float:
    """The lr multiplier of an orthogonal update of a ``[..., m, n]`` parameter."""
    m, n = shape[-2], shape[-1]
    if convention == "match_rms_adamw":
        return 0.2 * math.sqrt(max(m, n))
    return math.sqrt(max(1.0, m / n))


class Muon(torch.optim.Optimizer):
    """Muon for ``algorithm = "muon"`` groups, ``adam_cls`` (AdamW) for the others."""

    def __init__(
        self,
        param_groups: list[dict[str, Any]],
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        ns_dtype: torch.dtype = torch.float32,
        scale: str = "match_rms_adamw",
        adam_kwargs: dict[str, Any] | None = None,
    ) -> None:
        defaults: dict[str, Any] = dict(lr=lr, weight_decay=weight_decay, momentum=momentum)
        defaults.update(nesterov=nesterov)
        defaults.update(ns_steps=ns_steps, scale=scale, algorithm="adamw")
        super().__init__(param_groups, defaults)
        for g in self.param_groups:
            if g["algorithm"] == "muon":
                bad = [tuple(p.shape) for p in g["params"] if p.ndim not in (2, 3)]
                if bad:
                    raise ValueError(f"Muon takes 2-D matrices or 3-D expert stacks, not {bad}")
        self.ns_dtype = ns_dtype
        self.comm = CommStats()
        adam_groups = self._groups("adamw")
        self._adam = (
            torch.optim.AdamW(adam_groups, lr=lr, betas=betas, eps=eps, **(adam_kwargs or {}))
            if adam_groups
            else None
        )

    def _groups(self, algorithm: str) -> list[dict[str, Any]]:
        return [g for g in self.param_groups if g["algorithm"] == algorithm]

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._adam is not None:
            # The same group dicts and state (load_state_dict replaces both).
            self._adam.param_groups = self._groups("adamw")
            self._adam.state = self.state
            self._adam.step()
        self._muon_step(self._groups("muon"))
        return loss

    def _muon_step(self, groups: list[dict[str, Any]]) -> None:
        params, updates, owners = [], [], []
        for g in groups:
            mu = g["momentum"]
            for p in g["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - mu)
                updates.append(p.grad.lerp(buf, mu) if g["nesterov"] else buf)
                params.append(p)
                owners.append(g)
        if not params:
            return
        steps = owners[0]["ns_steps"]
        dtype = self.ns_dtype

        def ns(x: torch.Tensor) -> torch.Tensor:
            return newton_schulz(x, steps, dtype)

        ortho = orthogonalize(updates, ns, dtype, self.comm)
        for p, o, g in zip(params, ortho, owners):
            lr = g["lr"]
            p.mul_(1 - lr * g["weight_decay"])
            p.add_(o.to(p.dtype), alpha=-lr * update_scale(p.shape, g["scale"]))


__all__ = ["Muon", "newton_schulz", "update_scale"]
