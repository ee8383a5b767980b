"""Process-group start-up, device/backend detection, seeding, reductions and gradient clipping."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from torchtitan.tools.logging import logger


def device_type() -> str:
    """'cuda' when a GPU is visible, else 'cpu'. Never hard-coded anywhere else."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def backend_for(dev_type: str) -> str:
    # NCCL for GPU tensors; gloo for any CPU tensors (e.g. async-checkpoint staging).
    return "cuda:nccl,cpu:gloo" if dev_type == "cuda" else "gloo"


def init_distributed(init_timeout_s: int) -> tuple[torch.device, int, int]:
    """Start the default process group; returns (device, world_size, rank).

    Under torchrun the env:// rendezvous is used; a plain ``python -m torchtitan.train`` gets a
    one-rank group on an in-memory store, so every run goes through the same mesh code path.
    """
    dev_type = device_type()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if dev_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        timeout = timedelta(seconds=init_timeout_s)
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend_for(dev_type), timeout=timeout)
        else:
            dist.init_process_group(
                backend_for(dev_type), store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
    return device, dist.get_world_size(), dist.get_rank()


def set_pg_timeouts(timeout_s: int, mesh: DeviceMesh) -> None:
    """Switch the default group and every mesh group to the training timeout (after start-up)."""
    timeout = timedelta(seconds=timeout_s)
    groups = [c10d._get_default_group()]
    for name in mesh.mesh_dim_names or ():
        groups.append(mesh.get_group(name))
    for group in groups:
        c10d._set_pg_timeout(timeout, group)


def set_determinism(seed: int, deterministic: bool) -> None:
    """Seed every RNG (same on all ranks) and optionally force deterministic kernels."""
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=False)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        if torch.cuda.is_available():
            torch.backends.cudnn.deterministic = True
            torch.backends.cudnn.benchmark = False


def all_reduce_(t: torch.Tensor, mesh: DeviceMesh | None, op: str = "avg") -> torch.Tensor:
    """In-place all-reduce of a plain tensor over a (possibly flattened) 1-D mesh; gloo has no AVG."""
    if mesh is None or mesh.size() == 1:
        return t
    group = mesh.get_group()
    if op == "avg":
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        t.div_(mesh.size())
    elif op == "sum":
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    elif op == "max":
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    elif op == "min":
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    else:
        raise ValueError(f"unknown reduction {op!r}")
    return t


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[nn.Parameter],
    max_norm: float,
    norm_type: float = 2.0,
    pp_mesh: DeviceMesh | None = None,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Total gradient norm over every mesh axis (and pipeline stages), then clip in place.

    DTensor gradients reduce their partial norms over the axes they are sharded on; with
    pipeline parallel each stage holds different parameters, so the stage norms are combined
    with one more all-reduce over ``pp_mesh``. ``max_norm <= 0`` only measures.
    Returns the total norm as a plain 0-dim tensor.
    """
    params = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    total = torch.nn.utils.get_total_norm(
        grads, norm_type, error_if_nonfinite=False, foreach=foreach
    )
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if pp_mesh is not None and pp_mesh.size() > 1:
        if math.isinf(norm_type):
            all_reduce_(total, pp_mesh, op="max")
        else:
            total = total**norm_type
            all_reduce_(total, pp_mesh, op="sum")
            total = total ** (1.0 / norm_type)
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=foreach)
    return total


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    logger.debug("process group destroyed")
