"""Process-group start-up, device/backend detection, seeding, reductions and gradient clipping."""

from __future__ import annotations

import math
import os
import random
from collections.abc import Iterable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from torchtitan.tools.logging import logger

# Explicit override of the detected device: TORCHTITAN_DEVICE=cpu runs on CPU with gloo even where
# CUDA is visible (the test suite sets it; several ranks on one GPU must not share it with NCCL).
DEVICE_ENV = "TORCHTITAN_DEVICE"


def device_type() -> str:
    """'cuda' when a GPU is visible, else 'cpu', unless ``TORCHTITAN_DEVICE`` (cpu or cuda) says
    which. Never hard-coded anywhere else."""
    forced = os.environ.get(DEVICE_ENV, "").strip().lower()
    if forced not in ("", "cpu", "cuda"):
        raise ValueError(f"{DEVICE_ENV}={forced!r}: expected 'cpu' or 'cuda' (or unset: detect)")
    if forced == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"{DEVICE_ENV}=cuda but torch {torch.__version__} sees no CUDA device")
    if forced:
        return forced
    return "cuda" if torch.cuda.is_available() else "cpu"


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_dtype(name: str, dev_type: str) -> torch.dtype:
    """A ``training.mixed_precision_*`` name as a dtype. ``auto`` (param dtype) is bf16 on CUDA
    (tensor cores) and fp32 elsewhere (bf16 matmuls are slow on CPUs). The trainer, the
    estimator and explain all resolve it here."""
    if name == "auto":
        return torch.bfloat16 if dev_type == "cuda" else torch.float32
    return _DTYPES[name]


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
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"LOCAL_RANK {local_rank} but {torch.cuda.device_count()} CUDA device(s) visible: "
                f"one rank per GPU (NCCL cannot share a device); {DEVICE_ENV}=cpu runs the ranks "
                "on CPU with gloo"
            )
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
    random.seed(seed)  # Python's own RNG too: checkpoints save and restore it
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


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor's value as a plain tensor (e.g. the loss under loss parallel)."""
    if isinstance(t, DTensor):
        assert all(p.is_replicate() for p in t.placements), t.placements
        return t.to_local()
    return t


def _mesh_of(t: torch.Tensor | None) -> DeviceMesh | None:
    return t.device_mesh if isinstance(t, DTensor) else None


def _local_terms(
    grads: list[torch.Tensor], norm_type: float, foreach: bool | None
) -> dict[tuple[DeviceMesh | None, tuple[int, ...]], torch.Tensor]:
    """Each gradient's local share of the norm (sum of ``|x|^p``, or ``max |x|``), in fp32,
    summed per (mesh, axes its shards must be combined over)."""
    groups: dict[tuple[DeviceMesh | None, tuple[int, ...]], list[torch.Tensor]] = {}
    for g in grads:
        if isinstance(g, DTensor):
            # every axis that splits the tensor (Shard, FSDP x TP's _StridedShard: anything
            # neither replicated nor pending a sum; partial ones were reduced before)
            axes = tuple(
                i for i, pl in enumerate(g.placements) if not (pl.is_replicate() or pl.is_partial())
            )
            groups.setdefault((g.device_mesh, axes), []).append(g.to_local())
        else:
            groups.setdefault((None, ()), []).append(g)
    terms = {}
    for key, local in groups.items():
        norms: Sequence[torch.Tensor]
        if foreach is not False and all(t.device.type in ("cuda", "cpu") for t in local):
            norms = torch._foreach_norm(local, norm_type)
        else:
            norms = [torch.linalg.vector_norm(t, norm_type) for t in local]
        stacked = torch.stack([n.float() for n in norms])
        terms[key] = stacked.max() if math.isinf(norm_type) else (stacked**norm_type).sum()
    return terms


def total_grad_norm(
    grads: list[torch.Tensor], norm_type: float = 2.0, foreach: bool | None = None
) -> torch.Tensor:
    """The norm of all ``grads`` together, as a plain fp32 tensor, whatever their mesh or
    placement (a ``Partial`` gradient is reduced first: ``reduce_partial_grads``).

    Each gradient's local share is summed (or maxed) with the others sharded over the same mesh
    axes, then one all-reduce per axis completes that group: a handful of collectives per step
    instead of one per DTensor gradient (torch's ``get_total_norm`` on DTensors of mixed
    placements; docs/architecture.md, section 10).
    """
    grads = [_replicate_partial(g) for g in grads]
    op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
    total = None
    for (mesh, axes), term in _local_terms(grads, norm_type, foreach).items():
        if mesh is not None and axes:
            term = term.to(mesh.device_type)  # offloaded gradients: the collective's device
            for axis in axes:
                dist.all_reduce(term, op=op, group=mesh.get_group(axis))
        if total is None:
            total = term
        else:
            term = term.to(total.device)
            total = torch.maximum(total, term) if math.isinf(norm_type) else total + term
    assert total is not None
    return total if math.isinf(norm_type) else total ** (1.0 / norm_type)


def _replicate_partial(g: torch.Tensor) -> torch.Tensor:
    """``g`` with its pending (``Partial``) reductions done, as ``Replicate`` on those axes."""
    if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
        placements = [Replicate() if pl.is_partial() else pl for pl in g.placements]
        return g.redistribute(g.device_mesh, placements)
    return g


@torch.no_grad()
def reduce_partial_grads(parameters: Iterable[nn.Parameter]) -> None:
    """Sum the DTensor gradients still pending a reduction (``Partial``: a sequence-parallel
    norm weight's, whose parameter is replicated over ``tp``) into plain replicated ones, in
    place of ``p.grad``, before the clip scales them: torch 2.11's in-place multiply of a
    ``Partial`` DTensor by the clip coefficient leaves wrong values (docs/architecture.md,
    section 10). The optimizer would reduce them inside its first op on them anyway.

    Pending sums on the same mesh axes travel together: one all-reduce of their concatenation
    per axis (a model's norm weights: one collective per step, not one each)."""
    # one concatenation per (mesh, axes, dtype): torch.cat would promote a mix of dtypes
    groups: dict[
        tuple[DeviceMesh, tuple[int, ...], torch.dtype], list[tuple[nn.Parameter, DTensor]]
    ]
    groups = {}
    for p in parameters:
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            axes = tuple(i for i, pl in enumerate(g.placements) if pl.is_partial())
            if any(getattr(g.placements[i], "reduce_op", None) != "sum" for i in axes):
                p.grad = _replicate_partial(g)  # an average or max: DTensor's own reduction
                continue
            groups.setdefault((g.device_mesh, axes, g.dtype), []).append((p, g))
    for (mesh, axes, _), pairs in groups.items():
        locals_ = [g.to_local() for _, g in pairs]
        flat = torch.cat([t.reshape(-1) for t in locals_])
        for axis in axes:
            dist.all_reduce(flat, group=mesh.get_group(axis))
        for (p, g), t, part in zip(pairs, locals_, flat.split([t.numel() for t in locals_])):
            placements = [Replicate() if pl.is_partial() else pl for pl in g.placements]
            p.grad = DTensor.from_local(
                part.view_as(t), mesh, placements, run_check=False, shape=g.shape, stride=g.stride()
            )


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[nn.Parameter],
    max_norm: float,
    norm_type: float = 2.0,
    pp_mesh: DeviceMesh | None = None,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Total gradient norm over every mesh axis (and pipeline stages), then clip in place.

    DTensor gradients reduce their partial norms over the axes they are sharded on (FSDP's
    data axes, TP); with pipeline parallel each stage holds different parameters, so the stage
    norms are combined with one more all-reduce over ``pp_mesh`` (every stage must call this).
    ``max_norm <= 0`` only measures. Returns the total norm as a plain 0-dim tensor.
    """
    params = [p for p in parameters if p.grad is not None]
    reduce_partial_grads(params)  # once, for the norm and the clip
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        total = total_grad_norm(grads, norm_type, foreach)
    else:
        total = torch.zeros((), device=device_type())
    if pp_mesh is not None and pp_mesh.size() > 1:
        if math.isinf(norm_type):
            all_reduce_(total, pp_mesh, op="max")
        else:
            total = total**norm_type
            all_reduce_(total, pp_mesh, op="sum")
            total = total ** (1.0 / norm_type)
    if max_norm > 0:
        clip_grads_with_norm_(params, max_norm, total, foreach=foreach)
    return total


@torch.no_grad()
def clip_grads_with_norm_(
    parameters: Iterable[nn.Parameter],
    max_norm: float,
    total_norm: torch.Tensor,
    foreach: bool | None = None,
) -> None:
    """Scale gradients by ``max_norm / total_norm`` when that is below 1 (torch's function of the
    same name, applied per mesh group: foreach kernels refuse a mix of Tensor and DTensor)."""
    params = [p for p in parameters if p.grad is not None]
    reduce_partial_grads(params)
    by_mesh: dict[DeviceMesh | None, list[nn.Parameter]] = {}
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(_mesh_of(p.grad), []).append(p)
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total_norm, foreach=foreach)


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    logger.debug("process group destroyed")
