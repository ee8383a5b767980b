"""Data parallelism: FSDP2 / HSDP through ``fully_shard`` and DDP through FSDP2's ``replicate``."""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)


def reshard_policy(policy: Literal["default", "always", "never"], pp_enabled: bool) -> bool:
    """Resolve ``fsdp_reshard_after_forward``.

    default: reshard after forward (least memory), except under pipeline parallel where each
    stage runs several microbatches back to back and re-gathering per microbatch would multiply
    the all-gathers.
    """
    if policy == "always":
        return True
    if policy == "never":
        return False
    return not pp_enabled


def apply_fsdp(
    model: nn.Module,
    units: list[nn.Module],
    dp_mesh: DeviceMesh,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: bool,
    ignored_params: set[nn.Parameter] | None = None,
    cpu_offload: bool = False,
) -> None:
    """Shard ``model`` with FSDP2: one unit per module of ``units`` (the blocks), plus the root.

    ``dp_mesh`` is 1-D (FSDP over dp_shard x cp) or 2-D (HSDP: replicate x shard). The root unit
    holds what no unit took (embedding, final norm, output); it is not resharded after forward
    because its parameters are used again right at the start of backward. ``ignored_params``
    (expert-parallel experts) stay as they are.

    ``cpu_offload``: FSDP2's ``CPUOffloadPolicy``: parameter shards, gradient shards and so the
    optimizer state and step live in host memory; each unit's shards are copied to the device
    before its all-gather and its reduced gradients back (docs/memory.md). The model must be
    materialized on the CPU (``offload_device``). Host memory is pinned where the mesh is on an
    accelerator.
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    ign = ignored_params or None
    offload = (
        CPUOffloadPolicy(pin_memory=dp_mesh.device_type != "cpu")
        if cpu_offload
        else OffloadPolicy()
    )
    for unit in units:
        fully_shard(
            unit,
            mesh=dp_mesh,
            mp_policy=mp,
            reshard_after_forward=reshard_after_forward,
            ignored_params=ign,
            offload_policy=offload,
        )
    fully_shard(
        model,
        mesh=dp_mesh,
        mp_policy=mp,
        reshard_after_forward=False,
        ignored_params=ign,
        offload_policy=offload,
    )


def apply_ddp(
    model: nn.Module, dp_mesh: DeviceMesh, param_dtype: torch.dtype, reduce_dtype: torch.dtype
) -> None:
    """Replicate ``model`` over ``dp_mesh`` (all-reduce of gradients), FSDP2's replicate API."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    replicate(model, mesh=dp_mesh, mp_policy=mp)
