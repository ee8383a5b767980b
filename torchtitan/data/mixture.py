"""Weighted mixtures of tokenized and text sources, interleaved deterministically (docs/data.md).

Window ``g`` of the mixture's global order goes to the source with the largest deficit
``weight_s * (g + 1) - taken_s`` (weights normalised, ties to the first source), the
``taken_s``-th window of that source: after ``n`` windows every source has had
``weight_s * n`` of them to within one window. Every data-parallel rank walks the same global
order (choosing a source costs a few float operations) and reads only the windows
``p + dp_rank`` of each round, so the batch of a step does not depend on the data-parallel
degree and the state (position, per-source counts, text sources' stream positions) is the same
on every rank and valid at any degree.

Tokenized sources are read by arithmetic (``tokenized_dataset.WindowOrder``); a text source is
one stream tokenized on every rank (as ``data_sharding = "window"``), its windows of other ranks
skipped after tokenizing. When a source has given all its windows (one pass), ``exhausted =
"wrap"`` starts its next epoch (logged once per source and epoch) and ``"error"`` stops with an
error naming the source and the position.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np
import torch
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import Stateful

from torchtitan.data.dataloader import PackedTokenDataset, document_ids
from torchtitan.data.tokenized_dataset import WindowOrder

__all__ = ["MixtureDataset", "SourceRunOut", "TextSource", "TokenizedSource", "WindowSource"]

logger = logging.getLogger(__name__)
Exhausted = Literal["wrap", "error"]


class SourceRunOut(RuntimeError):
    """A mixture source ran out of data under ``training.mixture_exhausted = "error"``."""


def _run_out(name: str, taken: int) -> SourceRunOut:
    return SourceRunOut(
        f"mixture source {name!r} ran out after {taken} windows (one full pass) and "
        f"training.mixture_exhausted = 'error'; add data, lower its weight, train fewer steps, "
        f"or set training.mixture_exhausted = 'wrap' to start its next epoch"
    )


@dataclass
class TokenizedSource:
    """A pre-tokenized corpus: its window ``c`` by arithmetic."""

    name: str
    order: WindowOrder
    exhausted: Exhausted = "wrap"
    sequential = False

    def window(self, c: int) -> tuple[np.ndarray, np.ndarray]:
        epoch = self.order.epoch_of(c)
        if epoch > 0 and self.exhausted == "error":
            raise _run_out(self.name, c)
        if epoch > 0 and epoch != self.order.epoch_of(c - 1):
            logger.info(f"mixture source {self.name!r}: epoch {epoch} starts at its window {c}")
        return self.order.read(c)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class TextSource:
    """A text dataset tokenized and packed as one stream (every rank reads all of it)."""

    sequential = True

    def __init__(self, name: str, packed: PackedTokenDataset, eos_id: int) -> None:
        if packed.dp_world_size != 1:
            raise ValueError("a mixture's text source is one global stream (dp_world_size 1)")
        self.name, self.packed, self.eos_id = name, packed, eos_id
        self._it: Iterator[tuple[torch.Tensor, ...]] | None = None
        self._taken = 0

    def window(self, c: int) -> tuple[np.ndarray, np.ndarray]:
        if self._it is None:
            self._it = iter(self.packed)
        try:
            inputs, labels = next(self._it)[:2]
        except StopIteration:
            raise _run_out(self.name, c) from None
        tokens = torch.cat([inputs, labels[-1:]])
        return tokens.numpy(), document_ids(tokens, self.eos_id).numpy()

    def state_dict(self) -> dict[str, Any]:
        return self.packed.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.packed.load_state_dict(state)
        self._it = None


Source = TokenizedSource | TextSource


class WindowSource(Protocol):
    """What a mixture reads: a source's window ``c`` (for text, ``(tokens, doc_ids)``; for
    image-text, ``data/vlm_mixture.py``, a sample), and its checkpointed state."""

    name: str
    sequential: bool

    def window(self, c: int) -> Any: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class MixtureDataset(IterableDataset, Stateful):
    """This data-parallel rank's ``(inputs, labels[, doc_ids])`` windows of a weighted mixture."""

    sharding = "window"  # a global position: ParallelAwareDataloader reshards it

    def __init__(
        self,
        sources: list[Source] | list[WindowSource],
        weights: list[float],
        seq_len: int,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        with_doc_ids: bool = False,
    ) -> None:
        if len(sources) != len(weights) or not sources:
            raise ValueError("a mixture needs one weight per source and at least one source")
        if min(weights) <= 0:
            raise ValueError(f"mixture weights must be > 0, got {weights}")
        total = float(sum(weights))
        self.sources, self.weights = sources, [w / total for w in weights]
        self.seq_len, self.with_doc_ids = seq_len, with_doc_ids
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self._position, self._counts = 0, [0] * len(sources)
        self._pending: dict[str, Any] | None = None

    def choose(self, g: int, counts: list[int]) -> int:
        """The source of global window ``g`` given the windows each source has had."""
        deficits = [w * (g + 1) - c for w, c in zip(self.weights, counts)]
        return int(np.argmax(deficits))

    def source_tokens(self) -> dict[str, int]:
        """Tokens each source has given the whole run so far (all ranks): for the metrics."""
        return {s.name: c * self.seq_len for s, c in zip(self.sources, self._counts)}

    def metrics_fields(self) -> dict[str, int]:
        return {f"data/tokens_{name}": n for name, n in self.source_tokens().items()}

    def _item(self, window: Any) -> Any:
        """The row of a source's window: ``(inputs, labels[, doc_ids])``."""
        tokens, doc_ids = window
        t = torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int64))
        if self.with_doc_ids:
            return t[:-1], t[1:], torch.from_numpy(np.ascontiguousarray(doc_ids[:-1]))
        return t[:-1], t[1:]

    def __iter__(self) -> Iterator[Any]:
        if self._pending is not None:
            state, self._pending = self._pending, None
            self._position, self._counts = state["windows"], list(state["counts"])
            for s, st in zip(self.sources, state["sources"]):
                s.load_state_dict(st)
        else:
            self._position, self._counts = 0, [0] * len(self.sources)
        while True:
            mine = None
            for g in range(self._position, self._position + self.dp_world_size):
                k = self.choose(g, self._counts)
                source, c = self.sources[k], self._counts[k]
                self._counts[k] += 1
                if g - self._position == self.dp_rank:
                    mine = source.window(c)
                elif source.sequential:
                    source.window(c)  # a text stream must be read in order on every rank
            self._position += self.dp_world_size
            assert mine is not None
            yield self._item(mine)

    def state_dict(self) -> dict[str, Any]:
        if self._pending is not None:
            return copy.deepcopy(self._pending)
        return {
            "windows": self._position,
            "counts": list(self._counts),
            "sources": [s.state_dict() for s in self.sources],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        missing = {"windows", "counts", "sources"} - set(state_dict)
        if missing or len(state_dict["counts"]) != len(self.sources):
            raise ValueError(
                f"mixture: the saved state does not fit this mixture of {len(self.sources)} "
                f"sources (missing {sorted(missing)} or another number of sources)"
            )
        self._pending = copy.deepcopy(state_dict)
