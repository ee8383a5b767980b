"""How evaluation requests are ordered, batched and shared among data-parallel ranks.

Every rank receives the whole request list from lm-eval (docs/evaluation.md, "Parallelism").
:func:`shard` sorts it longest first (one padded length per batch, and the slowest batch first),
deals the sorted requests round-robin to the data-parallel ranks, and :func:`gather` puts the
answers back in lm-eval's order on every rank. A request's answer never depends on the batch or
the rank it landed in beyond floating-point reduction order, so results are the same at any
data-parallel degree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch.distributed as dist

T = TypeVar("T")

__all__ = ["batches", "gather", "shard"]


def shard(
    items: Sequence[T], length: Callable[[T], int], rank: int, world: int
) -> list[tuple[int, T]]:
    """This rank's share of ``items`` as ``(original index, item)``, longest first.

    Sorting is by descending ``length`` then original index (stable and the same on every rank);
    rank ``r`` takes sorted positions ``r, r + world, ...`` so every rank gets lengths alike."""
    order = sorted(range(len(items)), key=lambda i: (-length(items[i]), i))
    return [(i, items[i]) for i in order[rank::world]]


def batches(
    items: list[tuple[int, T]], size: int, same_length: Callable[[T], object] | None = None
) -> Iterator[list[tuple[int, T]]]:
    """Consecutive groups of at most ``size`` items; with ``same_length`` a group also holds only
    items of one length (generation runs them without padding)."""
    group: list[tuple[int, T]] = []
    for item in items:
        if group and (
            len(group) == size
            or (same_length is not None and same_length(item[1]) != same_length(group[0][1]))
        ):
            yield group
            group = []
        group.append(item)
    if group:
        yield group


def gather(
    mine: list[tuple[int, Any]], total: int, group: dist.ProcessGroup | None, world: int
) -> list[Any]:
    """Every rank's ``(original index, answer)`` pairs merged into one list in original order,
    on every rank of ``group`` (one ``all_gather_object``; none when ``world`` is 1)."""
    parts: list[Any] = [mine]
    if world > 1:
        parts = [None] * world
        dist.all_gather_object(parts, mine, group=group)
    out: list[Any] = [None] * total
    for part in parts:
        for index, answer in part:
            out[index] = answer
    missing = [i for i, a in enumerate(out) if a is None]
    assert not missing, f"requests {missing[:5]} got no answer"
    return out
