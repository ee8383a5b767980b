"""Deterministic parameter initialization that does not depend on the parallelism.

Every parameter is drawn from its own generator, seeded from the run seed and the parameter's
fully qualified name. The full (global) tensor is generated on the parameter's device and the
local shard is sliced out of it, so a rank holding a DTensor shard of ``layers.3.attention.wq``
gets exactly the values the single-process run has there, whatever the FSDP/TP/PP layout.
Pipeline stages that drop layers do not shift anyone's random stream.

The cost is one transient full-size tensor per parameter (one at a time).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


@dataclass(frozen=True)
class ParamInit:
    """How one parameter is initialized: ``trunc_normal`` (bounds +-cutoff*std), ``normal``, ones or zeros."""

    kind: Literal["trunc_normal", "normal", "ones", "zeros"]
    std: float = 0.0
    cutoff: float = 3.0


def param_seed(seed: int, fqn: str) -> int:
    """A 63-bit seed derived from the run seed and the parameter name (stable across processes)."""
    return (seed * 1_000_003 + zlib.crc32(fqn.encode())) % (2**63 - 1)


def _fill(full: torch.Tensor, spec: ParamInit, generator: torch.Generator) -> None:
    if spec.kind == "ones":
        full.fill_(1.0)
    elif spec.kind == "zeros":
        full.zero_()
    elif spec.kind == "normal":
        nn.init.normal_(full, mean=0.0, std=spec.std, generator=generator)
    else:
        bound = spec.cutoff * spec.std
        nn.init.trunc_normal_(full, mean=0.0, std=spec.std, a=-bound, b=bound, generator=generator)


@torch.no_grad()
def init_params_deterministic(
    module: nn.Module, plan: dict[str, ParamInit], seed: int, prefix_strip: str = ""
) -> None:
    """Initialize every parameter of ``module`` from ``plan`` (fqn -> ParamInit).

    Works on plain tensors and DTensors (any placements). A parameter missing from the plan is
    an internal error: the model must describe all of its parameters.
    """
    for fqn, param in module.named_parameters():
        key = fqn.removeprefix(prefix_strip)
        # torch.compile and activation checkpointing wrap modules and add name segments.
        key = key.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")
        if key not in plan:
            raise KeyError(f"no init rule for parameter {key!r}")
        spec = plan[key]
        local = param.to_local() if isinstance(param, DTensor) else param
        gen = torch.Generator(device=local.device)
        gen.manual_seed(param_seed(seed, key))
        full = torch.empty(param.shape, dtype=torch.float32, device=local.device)
        _fill(full, spec, gen)
        if isinstance(param, DTensor):
            shape, offset = compute_local_shape_and_global_offset(
                param.shape, param.device_mesh, param.placements
            )
            index = tuple(slice(o, o + s) for o, s in zip(offset, shape))
            local.copy_(full[index])
        else:
            local.copy_(full)
