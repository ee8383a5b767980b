"""Newton-Schulz orthogonalisation of whole matrices when FSDP, HSDP, TP or EP hold shards
(docs/optimizers.md, "Distributed Muon").

The scheme: updates with the same mesh, placements and shape are stacked into one batch
``[k, m, n]`` whose matrix dimensions carry the shards; one ``redistribute`` moves every
sharded mesh axis onto the stack dimension (``Shard(r) -> Shard(0)``: an all-to-all), so each
rank holds about ``k / ways`` whole matrices, orthogonalises them, and the reverse
``redistribute`` returns its shard of every result. Each matrix is orthogonalised once per
replica group (``Replicate`` axes, HSDP's ``dp_replicate``, stay replicated and compute alike),
and a rank sends and receives ``2 (ways - 1) / ways`` of its shard bytes per step, where an
all-gather per matrix would receive ``(ways - 1)`` times them and orthogonalise every matrix on
every rank. Dimensions before the last two are batch dimensions (experts): a tensor sharded only
there (EP, FSDP over ``efsdp`` on the expert dimension) is orthogonalised where it lies.

With ``CommStats.timed`` set (``benchmarks/muon_comm.py``) each collective is waited for and the
seconds spent in the collectives and in Newton-Schulz are added up; off by default, since the
wait removes any overlap of the return collective with what follows.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

NS = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class CommStats:
    """Bytes this rank moved for the orthogonalisation (sent; received is the same) and, when
    ``timed``, the seconds of its collectives (including waiting for the other ranks) and of
    Newton-Schulz on the whole matrices."""

    bytes_sent: int = 0
    steps: int = 0
    timed: bool = False
    comm_s: float = 0.0
    ns_s: float = 0.0


def _redistribute(t: DTensor, placements: list[Placement], stats: CommStats) -> torch.Tensor:
    """``t`` moved to ``placements``, its local tensor; waited for and timed under ``timed``."""
    if not stats.timed:
        return t.redistribute(t.device_mesh, placements).to_local()
    t0 = time.perf_counter()
    out = t.redistribute(t.device_mesh, placements).to_local()
    if isinstance(out, AsyncCollectiveTensor):
        out = out.wait()
    stats.comm_s += time.perf_counter() - t0
    return out


def _timed_ns(x: torch.Tensor, ns: NS, stats: CommStats) -> torch.Tensor:
    t0 = time.perf_counter()
    out = ns(x)
    stats.ns_s += time.perf_counter() - t0
    return out


def _matrix_sharded(p: Placement, ndim: int) -> bool:
    if isinstance(p, Shard):
        return p.dim % ndim >= ndim - 2
    return not isinstance(p, Replicate)  # Partial: reduce before orthogonalising


def _stays_local(u: torch.Tensor) -> bool:
    return not isinstance(u, DTensor) or not any(_matrix_sharded(p, u.ndim) for p in u.placements)


def _shifted(p: Placement, ndim: int) -> Placement:
    """``p`` on a stack of such tensors (one more leading dimension)."""
    if isinstance(p, _StridedShard):  # FSDP over TP on the same dimension
        return _StridedShard(p.dim % ndim + 1, split_factor=p.split_factor)
    return Shard(p.dim % ndim + 1) if isinstance(p, Shard) else p


def _rewrap(local: torch.Tensor, like: DTensor) -> DTensor:
    return DTensor.from_local(
        local, like.device_mesh, like.placements, shape=like.shape, stride=like.stride()
    )


def _local(u: torch.Tensor, ns: NS) -> torch.Tensor:
    if isinstance(u, DTensor):
        return _rewrap(ns(u.to_local()), u)
    return ns(u)


def _bucket_key(u: DTensor) -> tuple:
    return (id(u.device_mesh), tuple(u.placements), tuple(u.shape), u.dtype)


def _gathered(updates: list[DTensor], ns: NS, comm_dtype: torch.dtype, stats: CommStats) -> list:
    """Orthogonalise same-spec sharded updates: stack (padded with zero matrices to a multiple
    of the ranks that share them), all-to-all whole matrices onto ranks, Newton-Schulz there,
    all-to-all back. Matrix dimensions that do not split evenly are all-gathered instead (every
    rank then orthogonalises every matrix of the bucket)."""
    first = updates[0]
    mesh, ndim = first.device_mesh, first.ndim
    stacked_pl = [_shifted(p, ndim) for p in first.placements]
    ways, even = 1, True
    for p, size in zip(first.placements, mesh.shape):
        if _matrix_sharded(p, ndim):
            ways *= size
            even = even and isinstance(p, Shard) and first.shape[p.dim % ndim] % size == 0
    if not even:
        ways = 1
    whole_pl: list[Placement] = [
        (Shard(0) if even else Replicate()) if _matrix_sharded(p, ndim) else q
        for p, q in zip(first.placements, stacked_pl)
    ]
    locals_ = [u.to_local().to(comm_dtype) for u in updates]
    pad = -len(locals_) % ways
    locals_ += [torch.zeros_like(locals_[0])] * pad
    local = torch.stack(locals_)
    shape = torch.Size((len(locals_), *first.shape))
    stacked = DTensor.from_local(local, mesh, stacked_pl, shape=shape, stride=_contiguous(shape))
    ortho = _redistribute(stacked, whole_pl, stats)
    flat = _timed_ns(ortho.reshape(-1, *ortho.shape[-2:]), ns, stats)
    ortho = flat.reshape(ortho.shape).to(comm_dtype)
    back = DTensor.from_local(ortho, mesh, whole_pl, shape=shape, stride=_contiguous(shape))
    back_local = _redistribute(back, stacked_pl, stats)
    if even:  # an all-to-all each way
        stats.bytes_sent += 2 * local.numel() * local.element_size() * (ways - 1) // ways
    else:  # an all-gather: receives (ways - 1) x the shard, sends it as many times
        stats.bytes_sent += local.numel() * local.element_size() * (_ways(first) - 1)
    return [_rewrap(back_local[i].to(u.dtype), u) for i, u in enumerate(updates)]


def _ways(u: DTensor) -> int:
    n = 1
    for p, size in zip(u.placements, u.device_mesh.shape):
        n *= size if _matrix_sharded(p, u.ndim) else 1
    return n


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))


def orthogonalize(
    updates: list[torch.Tensor], ns: NS, comm_dtype: torch.dtype, stats: CommStats
) -> list[torch.Tensor]:
    """Newton-Schulz of every update, each matrix whole, returned with the update's layout."""
    out: list[torch.Tensor | None] = [None] * len(updates)
    buckets: dict[tuple, list[int]] = {}
    for i, u in enumerate(updates):
        if _stays_local(u):
            out[i] = _local(u, lambda x: _timed_ns(x, ns, stats))
        else:
            assert isinstance(u, DTensor)
            buckets.setdefault(_bucket_key(u), []).append(i)
    for idx in buckets.values():
        results = _gathered([updates[i] for i in idx], ns, comm_dtype, stats)  # type: ignore[misc]
        for i, r in zip(idx, results):
            out[i] = r
    stats.steps += 1
    return out  # type: ignore[return-value]


__all__ = ["CommStats", "orthogonalize"]
