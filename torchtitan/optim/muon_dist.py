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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

NS = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class CommStats:
    """Bytes this rank moved for the orthogonalisation (sent; received is the same)."""

    bytes_sent: int = 0
    steps: int = 0


def _matrix_sharded(p: Placement, ndim: int) -> bool:
    if isinstance(p, Shard):
        return p.dim % ndim >= ndim - 2
    return not isinstance(p, Replicate)  # Partial: reduce before orthogonalising


def _stays_local(u: torch.Tensor) -> bool:
    return not isinstance(u, DTensor) or not any(_matrix_sharded(p, u.ndim) for p in u.placements)


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
    """Orthogonalise same-spec sharded updates: stack, all-to-all whole matrices onto ranks,
    Newton-Schulz there, all-to-all back."""
    first = updates[0]
    mesh, ndim = first.device_mesh, first.ndim
    stacked_pl: list[Placement] = [
        Shard(p.dim % ndim + 1) if isinstance(p, Shard) else p for p in first.placements
    ]
    whole_pl: list[Placement] = [
        Shard(0) if _matrix_sharded(p, ndim) else q for p, q in zip(first.placements, stacked_pl)
    ]
    local = torch.stack([u.to_local().to(comm_dtype) for u in updates])
    shape = (len(updates), *first.shape)
    stacked = DTensor.from_local(
        local, mesh, stacked_pl, shape=torch.Size(shape), stride=_contiguous(shape)
    )
    whole = stacked.redistribute(mesh, whole_pl)
    ortho = whole.to_local()
    ortho = ns(ortho.reshape(-1, *ortho.shape[-2:])).reshape(ortho.shape).to(comm_dtype)
    back = DTensor.from_local(
        ortho, mesh, whole_pl, shape=torch.Size(shape), stride=_contiguous(shape)
    ).redistribute(mesh, stacked_pl)
    ways = 1
    for p, size in zip(first.placements, mesh.shape):
        ways *= size if _matrix_sharded(p, ndim) else 1
    stats.bytes_sent += 2 * local.numel() * local.element_size() * (ways - 1) // ways
    back_local = back.to_local()
    return [_rewrap(back_local[i].to(u.dtype), u) for i, u in enumerate(updates)]


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
            out[i] = _local(u, ns)
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
