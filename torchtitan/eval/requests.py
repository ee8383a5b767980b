"""How evaluation requests are ordered, batched and shared among data-parallel ranks.

Every rank receives the whole request list from lm-eval (docs/evaluation.md, "Parallelism").
:func:`rank_batches` sorts it longest first (one padded length per batch, and the slowest batch
first), cuts the sorted list into batches, and deals whole batches round-robin to the
data-parallel ranks; :func:`gather` puts the answers back in lm-eval's order on every rank.
Batches are cut before they are dealt, so each batch (its rows, its padded width) is the same at
any data-parallel degree: a request's answer is bitwise the same on 1 rank or many.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch.distributed as dist

T = TypeVar("T")

__all__ = ["batches", "gather", "rank_batches"]


def rank_batches(
    items: Sequence[T],
    length: Callable[[T], int],
    size: int,
    rank: int,
    world: int,
    same_length: Callable[[T], object] | None = None,
) -> list[list[tuple[int, T]]]:
    """This rank's batches of ``items``, each a list of ``(original index, item)``.

    Sorting is by descending ``length`` then original index (stable and the same on every rank);
    the sorted list is cut by :func:`batches` and rank ``r`` takes batches ``r, r + world, ...``
    (every rank gets lengths alike, the longest first)."""
    order = sorted(range(len(items)), key=lambda i: (-length(items[i]), i))
    every = list(batches([(i, items[i]) for i in order], size, same_length))
    return every[rank::world]


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
