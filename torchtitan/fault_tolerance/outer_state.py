"""DiLoCo's state beyond the model and the inner optimizer, as a part of the DCP checkpoint
(``diloco``; docs/fault_tolerance.md, "Semi-synchronous training"):

- ``diloco.synced.<name>``: the weights of the last sync (torchft keeps them on the host, as
  local shards), which the next sync's pseudo-gradients are taken against;
- ``diloco.momentum.<name>``: the outer optimizer's momentum (zeros before the first outer step
  and under plain SGD, ``outer_momentum = 0``: one key set whatever the settings).

Both are saved like the parameters they belong to, under the same checkpoint names: a DTensor of
the parameter's mesh and placements where the parameter is one (FSDP/TP shards), so DCP
reshards them at load like the weights. The checkpointer is built (and loads) before the replica
group: a loaded state waits here until ``SemiSync`` hands over torchft's DiLoCo (``attach``).
LocalSGD has no state of its own besides the inner-step count, which is the step modulo
``sync_every`` (every step counts, semi_sync.py) and is set from the resumed step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan.config.sections import DILOCO_PART, FaultTolerance
from torchtitan.tools.logging import logger

OUTER_LR = 0.7  # the DiLoCo paper's outer learning rate and Nesterov momentum
OUTER_MOMENTUM = 0.9


def outer_settings(ft: FaultTolerance) -> tuple[float, float]:
    """DiLoCo's (outer lr, outer momentum): the configured ones, else the paper's."""
    lr = OUTER_LR if ft.outer_lr is None else float(ft.outer_lr)
    momentum = OUTER_MOMENTUM if ft.outer_momentum is None else float(ft.outer_momentum)
    return lr, momentum


PART = DILOCO_PART  # the checkpoint part's name
_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.")


def checkpoint_name(name: str) -> str:
    """``<part index>.<name>`` of ``nn.ModuleList(model_parts)`` as the checkpoint spells the
    parameter: without the part index (pipeline stages keep the full model's names) and the
    activation-checkpoint or compile wrapper segments."""
    name = name.split(".", 1)[1]
    for w in _WRAPPERS:
        name = name.replace(w, "")
    return name


def checkpoint_parts(ft: FaultTolerance, model_parts: list[nn.Module]) -> dict[str, Any]:
    """The checkpoint parts fault tolerance adds: DiLoCo's outer state, else none (a job with
    fault tolerance off, synchronous or LocalSGD saves exactly what it saved before)."""
    if ft.enable and ft.semi_sync == "diloco":
        return {PART: OuterState(ft, model_parts)}
    return {}


def _like(t: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``t`` (a local shard) as ``param`` is: a DTensor of its mesh and placements, or as is."""
    if isinstance(param, DTensor):
        return DTensor.from_local(
            t, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
        )
    return t


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class OuterState:
    """DiLoCo's outer optimizer (built here, before the checkpoint load) and, once attached,
    torchft's copy of the last synced weights; ``state_dict``/``load_state_dict`` are the
    checkpoint's (``CheckpointManager.extra_state``)."""

    def __init__(self, ft: FaultTolerance, model_parts: list[nn.Module]) -> None:
        lr, self.momentum = outer_settings(ft)
        self.model = nn.ModuleList(model_parts)  # the module torchft's DiLoCo wraps
        self.names = {n: checkpoint_name(n) for n, _ in self.model.named_parameters()}
        self.optimizer = torch.optim.SGD(
            list(self.model.parameters()),
            lr=lr,
            momentum=self.momentum,
            nesterov=self.momentum > 0,
        )
        self.synced: dict[str, torch.Tensor] | None = None  # torchft's, keyed as in self.model
        self._loaded: dict[str, Any] | None = None

    def _momentum(self, p: torch.Tensor) -> torch.Tensor:
        buf = self.optimizer.state.get(p, {}).get("momentum_buffer")
        return buf if buf is not None else torch.zeros_like(p.detach())

    def state_dict(self) -> dict[str, Any]:
        """The saved state, or (before ``attach``) the load's targets: shaped and sharded like
        the parameters, with DiLoCo's starting values (the current weights, no momentum)."""
        synced: dict[str, torch.Tensor] = {}
        momentum: dict[str, torch.Tensor] = {}
        for name, p in self.model.named_parameters():
            key = self.names[name]
            if self.synced is not None:
                synced[key] = _like(self.synced[name], p)
            else:
                synced[key] = p.detach().clone()
            momentum[key] = self._momentum(p)
        return {"synced": synced, "momentum": momentum}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Keep the loaded state until torchft's DiLoCo exists (``attach``)."""
        self._loaded = sd
        if self.synced is not None:
            self._apply()

    def attach(self, synced: dict[str, torch.Tensor], step: int) -> None:
        """torchft's last-synced weights (filled with the current weights by its constructor);
        a loaded state replaces them and the outer momentum now."""
        self.synced = synced
        if self._loaded is not None:
            self._apply()
        elif step > 0:
            logger.warning(
                f"fault tolerance: DiLoCo starts at step {step} without an outer state of its "
                "own (the checkpoint has no 'diloco' part): the last synced weights are the "
                "loaded weights and the outer momentum starts at zero"
            )

    def _apply(self) -> None:
        assert self.synced is not None and self._loaded is not None
        sd, self._loaded = self._loaded, None
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                key = self.names[name]
                self.synced[name].copy_(_local(sd["synced"][key]))
                if self.momentum > 0:
                    self.optimizer.state[p]["momentum_buffer"] = sd["momentum"][key]
        logger.info("fault tolerance: DiLoCo's last synced weights and outer momentum loaded")
