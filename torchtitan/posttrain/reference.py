"""The reference model of DPO and GRPO's KL term (docs/posttrain.md, "The reference").

Two forms, neither a second model object:

- **LoRA** (``lora.enable``): the reference is the base, i.e. the policy with its adapters
  switched off (:func:`adapters_off` sets every adapter's scaling to 0 for the reference forward,
  so ``base + 0 * delta`` is the base's output exactly). No memory beyond the policy.
- **Full fine-tuning**: :class:`FrozenReference` keeps a frozen copy of this rank's *shards* of
  every trainable parameter (sharded like the policy under FSDP/TP: 1x the sharded parameter
  bytes, no gradient, no optimizer state), taken when training starts. For the reference forward
  it swaps the copy into the policy's parameters in place (a scratch buffer of the largest shard
  in between) and swaps back after; FSDP modules are resharded after the forward so no gathered
  policy weight outlives it. The copy is part of the checkpoint (``state_dict``), so a resumed run
  keeps the reference it started with.

The alternative, precomputing the reference log-probs in a first pass over the data, costs no
parameter memory but a pass before training and ties the reference to the data order; it is not
implemented (docs/posttrain.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from torchtitan.lora.layers import LoRAExperts, LoRALinear


def _adapted(parts: list[nn.Module]) -> list[nn.Module]:
    return [m for p in parts for m in p.modules() if isinstance(m, LoRALinear | LoRAExperts)]


def has_adapters(parts: list[nn.Module]) -> bool:
    return bool(_adapted(parts))


@contextlib.contextmanager
def adapters_off(parts: list[nn.Module]) -> Iterator[None]:
    """Every LoRA adapter of ``parts`` contributes nothing inside the context."""
    modules = _adapted(parts)
    saved = [m.scaling for m in modules]
    try:
        for m in modules:
            setattr(m, "scaling", 0.0)  # noqa: B010 - LoRALinear and LoRAExperts both have it
        yield
    finally:
        for m, s in zip(modules, saved, strict=True):
            setattr(m, "scaling", s)  # noqa: B010


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def _reshard(parts: list[nn.Module]) -> None:
    for part in parts:
        for m in part.modules():
            if isinstance(m, FSDPModule):
                m.reshard()


class FrozenReference:
    """A frozen copy of the trainable parameters' local shards; see the module docstring."""

    def __init__(self, parts: list[nn.Module]) -> None:
        self.parts = parts
        self.names = [n for part in parts for n, p in part.named_parameters() if p.requires_grad]
        self.params = [p for part in parts for p in part.parameters() if p.requires_grad]
        with torch.no_grad():
            self.copies = [_local(p).detach().clone() for p in self.params]
        largest = max((c.numel() for c in self.copies), default=0)
        dtype = self.copies[0].dtype if self.copies else torch.float32
        device = self.copies[0].device if self.copies else torch.device("cpu")
        self._scratch = torch.empty(largest, dtype=dtype, device=device)

    @torch.no_grad()
    def _swap(self) -> None:
        for p, c in zip(self.params, self.copies, strict=True):
            local = _local(p)
            tmp = self._scratch[: local.numel()].view_as(local)
            tmp.copy_(local)
            local.copy_(c)
            c.copy_(tmp)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The policy's parameters hold the reference's values inside the context."""
        _reshard(self.parts)
        self._swap()
        try:
            yield
        finally:
            _reshard(self.parts)
            self._swap()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.copies, strict=True))

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for n, c in zip(self.names, self.copies, strict=True):
                c.copy_(_local(sd[n]))

    def sharded_state_dict(self) -> dict[str, torch.Tensor]:
        """The copies as tensors laid out like their parameters (DTensors over the same mesh
        and placements under FSDP/TP), sharing the copies' storage: what a distributed
        checkpoint saves, and loads into in place."""
        out = {}
        for n, p, c in zip(self.names, self.params, self.copies, strict=True):
            if isinstance(p, DTensor):
                c = DTensor.from_local(
                    c,
                    p.device_mesh,
                    p.placements,
                    run_check=False,
                    shape=p.shape,
                    stride=p.stride(),
                )
            out[n] = c
        return out


class Reference:
    """The reference forward of a run: adapters off under LoRA, else a :class:`FrozenReference`;
    ``None`` parts for reference-free losses."""

    def __init__(self, parts: list[nn.Module], frozen: bool | None = None) -> None:
        """``frozen``: a :class:`FrozenReference` (True), the adapters off (False: the parts
        must have adapters), or the first under full fine-tuning, the second under LoRA (None)."""
        if frozen is None:
            frozen = not has_adapters(parts)
        if not frozen and not has_adapters(parts):
            raise ValueError("a reference with the adapters off needs LoRA adapters")
        self.frozen = FrozenReference(parts) if frozen else None
        self.parts = parts

    def active(self) -> contextlib.AbstractContextManager[None]:
        return adapters_off(self.parts) if self.frozen is None else self.frozen.active()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {} if self.frozen is None else self.frozen.state_dict()

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        if self.frozen is not None:
            self.frozen.load_state_dict(sd)
