"""Replica fault tolerance's pure parts (docs/fault_tolerance.md): each replica group's share of
the data, and the data position a recovering group takes from its peer."""

from __future__ import annotations

import itertools

import torch

from torchtitan.config.sections import FaultTolerance
from torchtitan.data.dataloader import build_dataloader
from torchtitan.data.tokenizer import build_tokenizer
from torchtitan.fault_tolerance.replica import data_position, data_shard, load_data_position


def test_each_group_reads_its_own_share() -> None:
    off = FaultTolerance()
    assert data_shard(off, 1, 2) == (1, 2)  # fault tolerance off: unchanged
    ft = FaultTolerance(enable=True, replica_id=2, group_size=3)
    shards = {
        data_shard(FaultTolerance(enable=True, replica_id=g, group_size=3), r, 2)
        for g in range(3)
        for r in range(2)
    }
    assert shards == {(i, 6) for i in range(6)}  # every (group, rank) a distinct shard
    assert data_shard(ft, 1, 2) == (5, 6)


def _loader(group: int):  # noqa: ANN202
    tok = build_tokenizer("tests/assets/tokenizer")
    return build_dataloader("test_corpus", None, tok, 32, 2, group, 2, split="train")


def test_peer_position_is_the_recovering_groups_own() -> None:
    """A group that restarts takes group 0's data position after 5 steps; it must then draw
    exactly the batches its own shard would have given at step 6, 7, 8 (window sharding)."""
    peer = _loader(0)
    peer_batches = iter(peer)
    for _ in range(5):
        next(peer_batches)
    position = data_position(peer)

    uninterrupted = _loader(1)  # what group 1 would have drawn without the failure
    expected = list(itertools.islice(iter(uninterrupted), 8))[5:]

    restarted = _loader(1)
    load_data_position(restarted, position)
    got = list(itertools.islice(iter(restarted), 3))
    for (x, y), (ex, ey) in zip(got, expected, strict=True):
        assert torch.equal(x, ex) and torch.equal(y, ey)
    # and it is not the peer's data
    assert not torch.equal(got[0][0], next(peer_batches)[0])
