"""The ``chat`` dataset: JSONL conversations -> fixed-length rows with prompt-masked labels
(docs/sft.md).

Every rank reads and tokenizes the whole file once, at construction (SFT sets are small; the
rows are held as numpy arrays), so the rows and their global order are known up front:

- ``packing = "pack"``: conversations, in file order, are packed greedily into rows of
  ``seq_len`` (input, label) pairs; a conversation that does not fit in the current row starts
  the next one, which is padded. ``doc_ids`` number the conversations of a row (the padding gets
  its own id), so ``model.attn_mask_type = "block_causal"`` keeps them apart.
- ``packing = "pad"``: one conversation per row, padded.

A conversation of ``L`` tokens gives ``L - 1`` (input, label) pairs: inputs ``ids[:-1]``,
labels ``ids[1:]`` where that token is trained (an assistant turn's content or end of turn),
else ``IGNORE_INDEX``; padding has ``IGNORE_INDEX`` labels. Longer than ``seq_len`` pairs:
``overlong`` truncates (a conversation left with no trained token is dropped), drops, or raises.

Rows are shared like ``data_sharding = "window"``: global row ``g`` (the rows repeat epoch after
epoch) goes to data-parallel rank ``g % dp``, so the global batch is the same at any
data-parallel degree and the resume state, the next global row of a round, is valid at any
degree too.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import Stateful

from torchtitan.data.chat_template import (
    ChatTokenizer,
    read_conversations,
    resolve_chat_template,
    tokenize_conversation,
)
from torchtitan.loss.cross_entropy import IGNORE_INDEX
from torchtitan.tools.paths import resolve_repo_path

__all__ = ["ChatDataset", "Packing", "Overlong", "tokenized_conversations"]

logger = logging.getLogger(__name__)

Packing = Literal["pack", "pad"]
Overlong = Literal["truncate", "drop", "error"]
TemplateChoice = Literal["auto", "default", "tokenizer"]


def tokenized_conversations(
    path: str | Path,
    tokenizer: ChatTokenizer,
    seq_len: int,
    overlong: Overlong,
    template: TemplateChoice = "auto",
) -> tuple[list[tuple[np.ndarray, np.ndarray]], int]:
    """(inputs, labels) int64 pairs of every conversation of ``path`` after the ``overlong``
    policy, and the number dropped. ``ValueError`` names the file and line of a bad record or
    (``overlong = "error"``) of the first conversation longer than ``seq_len``."""
    jinja = resolve_chat_template(tokenizer, template)
    out: list[tuple[np.ndarray, np.ndarray]] = []
    dropped = 0
    for lineno, messages in read_conversations(path):
        ids, train = tokenize_conversation(tokenizer, messages, jinja)
        if len(ids) - 1 > seq_len:
            if overlong == "error":
                raise ValueError(
                    f"{path}:{lineno}: conversation of {len(ids)} tokens is longer than "
                    f"training.seq_len + 1 = {seq_len + 1}; raise training.seq_len or set "
                    f"sft.overlong to 'truncate' or 'drop'"
                )
            if overlong == "drop":
                dropped += 1
                continue
            ids, train = ids[: seq_len + 1], train[: seq_len + 1]
        tokens = np.asarray(ids, dtype=np.int64)
        labels = np.where(np.asarray(train[1:], dtype=bool), tokens[1:], IGNORE_INDEX)
        if not (labels != IGNORE_INDEX).any():  # truncated before any assistant token
            dropped += 1
            continue
        out.append((tokens[:-1], labels))
    return out, dropped


def _rows(
    convs: list[tuple[np.ndarray, np.ndarray]], seq_len: int, packing: Packing
) -> list[list[int]]:
    """Conversation indices of each row."""
    rows: list[list[int]] = []
    used = seq_len  # forces a new row for the first conversation
    for i, (inputs, _) in enumerate(convs):
        if packing == "pad" or used + len(inputs) > seq_len:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += len(inputs)
    return rows


class StridedRows:
    """A dataset's walk over its ``n`` rows for one data-parallel rank: round ``r`` gives rank
    ``dp_rank`` global row ``r * dp_world_size + dp_rank`` (modulo ``n`` when ``infinite``);
    the position saved is the first global row of the next round, the same on every rank, and
    a loaded position applies when iteration starts (``_resume``)."""

    dp_rank: int
    dp_world_size: int
    infinite: bool
    _next: int = 0  # first global row of the next round
    _resume: int | None = None  # a loaded position, applied when iteration starts

    def _rank_rows(self, n: int) -> Iterator[int]:
        self._next, self._resume = self._resume or 0, None  # a new iter() starts at 0
        while self.infinite or self._next < n:
            g = self._next + self.dp_rank
            self._next += self.dp_world_size  # every rank saves the same round boundary
            if not self.infinite and g >= n:
                return
            yield g % n

    state_key = "next_row"
    """The position's key in ``state_dict``."""

    if TYPE_CHECKING:  # each dataset's own: its number of rows, global row ``index``

        def __len__(self) -> int: ...

        def row(self, index: int) -> tuple[torch.Tensor, ...]: ...

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        for g in self._rank_rows(len(self)):
            yield self.row(g)

    def state_dict(self) -> dict[str, Any]:
        return {self.state_key: self._next if self._resume is None else self._resume}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.state_key not in state_dict:
            name = type(self).__name__
            raise ValueError(
                f"{name} state is missing {self.state_key!r} (got {sorted(state_dict)})"
            )
        self._resume = int(state_dict[self.state_key])


class ChatDataset(StridedRows, IterableDataset, Stateful):
    """Rows of ``(inputs, labels)`` (``+ doc_ids`` with ``with_doc_ids``) of one data-parallel
    rank; see the module docstring. ``infinite=False`` makes one pass (validation)."""

    sharding = "window"  # the resume state is a global position (ParallelAwareDataloader)

    def __init__(
        self,
        path: str | Path,
        tokenizer: ChatTokenizer,
        seq_len: int,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        infinite: bool = True,
        packing: Packing = "pack",
        overlong: Overlong = "truncate",
        template: TemplateChoice = "auto",
        with_doc_ids: bool = False,
    ) -> None:
        self.path = resolve_repo_path(path)
        if not self.path.is_file():
            raise ValueError(f"chat dataset {str(path)!r} is not a file (docs/sft.md)")
        self.seq_len, self.infinite, self.with_doc_ids = seq_len, infinite, with_doc_ids
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.pad_id = tokenizer.eos_id
        self._convs, dropped = tokenized_conversations(
            self.path, tokenizer, seq_len, overlong, template
        )
        if not self._convs:
            raise ValueError(f"chat dataset {self.path}: no conversation left to train on")
        self._rows = _rows(self._convs, seq_len, packing)
        trained = sum(int((lab != IGNORE_INDEX).sum()) for _, lab in self._convs)
        logger.info(
            f"chat dataset {self.path}: {len(self._convs)} conversations ({dropped} dropped as "
            f"longer than seq_len {seq_len}) in {len(self._rows)} {packing}ed rows; "
            f"{trained:,} trained tokens per epoch"
        )
        self._next, self._resume = 0, None

    def __len__(self) -> int:
        return len(self._rows)

    def row(self, index: int) -> tuple[torch.Tensor, ...]:
        """Row ``index`` (of one epoch): inputs, labels and, with ``with_doc_ids``, doc ids."""
        inputs = np.full(self.seq_len, self.pad_id, dtype=np.int64)
        labels = np.full(self.seq_len, IGNORE_INDEX, dtype=np.int64)
        doc_ids = np.zeros(self.seq_len, dtype=np.int32)
        pos = 0
        for k, c in enumerate(self._rows[index]):
            conv_inputs, conv_labels = self._convs[c]
            n = len(conv_inputs)
            inputs[pos : pos + n], labels[pos : pos + n] = conv_inputs, conv_labels
            doc_ids[pos : pos + n] = k
            pos += n
        doc_ids[pos:] = len(self._rows[index])  # the padding is a document of its own
        out = (torch.from_numpy(inputs), torch.from_numpy(labels))
        return (*out, torch.from_numpy(doc_ids)) if self.with_doc_ids else out
