"""Packed training windows read from a pre-tokenized corpus by arithmetic (docs/data.md).

:class:`WindowOrder` maps window ``i`` of the global order to its tokens without reading
anything else: with ``shuffle = "none"`` window ``i`` is tokens ``[i*W, (i+1)*W)`` of the corpus
repeated forever (``W = seq_len + 1``), exactly the text path's window stream; ``"windows"``
visits each epoch's ``N // W`` whole windows in a seeded pseudo-random order (a Feistel
permutation computed per index, O(1) memory); ``"documents"`` cuts windows from the documents
concatenated in a seeded random order, new each epoch (building it reads the document index
once per epoch, O(documents), never the tokens).

:class:`TokenizedDataset` gives data-parallel rank ``r`` of ``dp`` the windows ``p + r`` of each
round starting at position ``p`` (``p`` advancing by ``dp``), as the text path's window sharding
does: the global batch of a step is the same at any data-parallel degree, and the state is one
number, the global window position (``step x global_batch_size`` in training), valid at any
data-parallel degree.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any, Literal

import numpy as np
import torch
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import Stateful

from torchtitan.data.token_shards import TokenCorpus

__all__ = ["Shuffle", "TokenizedDataset", "WindowOrder", "feistel_permute"]

Shuffle = Literal["none", "windows", "documents"]
_M64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """A 64-bit integer hash (the splitmix64 finalizer)."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def feistel_permute(j: int, n: int, key: int, rounds: int = 4) -> int:
    """Position of ``j`` in a pseudo-random permutation of ``range(n)`` chosen by ``key``.

    A Feistel network is a bijection of ``[0, 2**bits)``; applying it until the value falls
    inside ``[0, n)`` (cycle walking, fewer than 4 tries on average) restricts it to a bijection
    of ``range(n)``. Each call is O(1): no permutation table."""
    if not 0 <= j < n:
        raise IndexError(f"{j} is outside range({n})")
    bits = max(2, (n - 1).bit_length())
    bits += bits % 2
    half, mask = bits // 2, (1 << (bits // 2)) - 1
    x = j
    while True:
        left, right = x >> half, x & mask
        for r in range(rounds):
            left, right = right, left ^ (_mix(key ^ _mix(r) ^ right) & mask)
        x = (left << half) | right
        if x < n:
            return x


class WindowOrder:
    """Window ``i`` of a corpus's global order: its ``W`` tokens and their document ids."""

    def __init__(self, corpus: TokenCorpus, window: int, shuffle: Shuffle = "none", seed: int = 0):
        if shuffle not in ("none", "windows", "documents"):
            raise ValueError(f"shuffle must be none, windows or documents, got {shuffle!r}")
        self.corpus, self.window, self.shuffle, self.seed = corpus, window, shuffle, seed
        self.per_epoch = corpus.num_tokens // window  # whole windows in one pass
        if self.per_epoch < 1:
            raise ValueError(
                f"{corpus.folder}: {corpus.num_tokens} tokens, fewer than one window of "
                f"seq_len + 1 = {window}"
            )
        self._epoch_cache: tuple[int, np.ndarray, np.ndarray, np.ndarray] | None = None

    def epoch_of(self, i: int) -> int:
        """The pass over the corpus window ``i`` belongs to (0 for the first)."""
        if self.shuffle == "none":
            return ((i + 1) * self.window - 1) // self.corpus.num_tokens
        return i // self.per_epoch

    def _key(self, epoch: int) -> int:
        return _mix(_mix(self.seed & _M64) ^ epoch)

    def _documents(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(document order, their start offsets, cumulative lengths) of an epoch, cached."""
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            bounds = self.corpus.doc_bounds()
            order = np.random.Generator(np.random.PCG64([self.seed & _M64, epoch])).permutation(
                len(bounds) - 1
            )
            lengths = np.diff(bounds)[order]
            cum = np.concatenate([[0], np.cumsum(lengths)])
            self._epoch_cache = (epoch, order, bounds[:-1][order], cum)
        return self._epoch_cache[1:]

    def read(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens int64, document ids int32) of window ``i``."""
        w = self.window
        if self.shuffle == "none":
            return self.corpus.read(i * w, w)
        epoch, j = divmod(i, self.per_epoch)
        if self.shuffle == "windows":
            return self.corpus.read(feistel_permute(j, self.per_epoch, self._key(epoch)) * w, w)
        _, starts, cum = self._documents(epoch)
        pos, end = j * w, (j + 1) * w
        d = int(np.searchsorted(cum, pos, side="right")) - 1
        spans = []
        while pos < end:
            a = int(starts[d]) + pos - int(cum[d])
            take = min(end, int(cum[d + 1])) - pos
            spans.append((a, a + take))
            pos, d = pos + take, d + 1
        return self.corpus.read_docs(spans)


class TokenizedDataset(IterableDataset, Stateful):
    """This data-parallel rank's ``(inputs, labels[, doc_ids])`` windows of a token corpus.

    ``infinite=False`` makes one pass (the whole rounds of ``dp`` windows that fit in
    ``per_epoch``); otherwise epochs follow each other (docs/data.md)."""

    sharding = "window"  # the state is a global position: ParallelAwareDataloader reshards it

    def __init__(
        self,
        corpus: TokenCorpus,
        seq_len: int,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        shuffle: Shuffle = "none",
        seed: int = 0,
        infinite: bool = True,
        with_doc_ids: bool = False,
        name: str = "tokenized",
    ) -> None:
        if seq_len < 1:
            raise ValueError(f"training.seq_len must be >= 1, got {seq_len}")
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank must be in [0, {dp_world_size}), got {dp_rank}")
        self.order = WindowOrder(corpus, seq_len + 1, shuffle, seed)
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.infinite, self.with_doc_ids, self.name = infinite, with_doc_ids, name
        self._position = 0  # global index of the next round's first window
        self._pending: int | None = None

    def item(self, index: int) -> tuple[torch.Tensor, ...]:
        """The training item of global window ``index``."""
        tokens, doc_ids = self.order.read(index)
        t = torch.from_numpy(tokens)
        if self.with_doc_ids:
            return t[:-1], t[1:], torch.from_numpy(doc_ids[:-1].copy())
        return t[:-1], t[1:]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        self._position = self._pending if self._pending is not None else 0
        self._pending = None
        while self.infinite or self._position + self.dp_world_size <= self.order.per_epoch:
            index = self._position + self.dp_rank
            self._position += self.dp_world_size
            yield self.item(index)

    def state_dict(self) -> dict[str, Any]:
        return {"windows": self._pending if self._pending is not None else self._position}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "windows" not in state_dict:
            raise ValueError(
                f"dataset {self.name!r}: state has no 'windows' ({sorted(state_dict)})"
            )
        self._pending = int(copy.deepcopy(state_dict["windows"]))
