"""Preference pairs for DPO (docs/posttrain.md): a JSONL file or a Hugging Face dataset saved
with ``save_to_disk``, one pair per record::

    {"prompt": [{"role": "user", "content": "..."}], "chosen": "...", "rejected": "..."}

``prompt`` is a list of messages (or a string: one user message); ``chosen`` and ``rejected``
are the assistant's answer (a string, or a list of messages as TRL's conversational format).
Each side is rendered with our chat template (``data/chat_template.py``) after the prompt; only
the completion's tokens are labelled (the prompt is masked like SFT's, docs/sft.md). A pair is
one row of ``(chosen inputs, chosen labels, rejected inputs, rejected labels)``, each padded to
``seq_len``; the DPO step runs both sides in one forward.

Bad input raises a :class:`DataError` naming the file and record: an empty chosen or rejected
side, a prompt that leaves no room for a completion in ``seq_len``. A completion that does not
fit is truncated (TRL's default). Rows are dealt to data-parallel ranks like the chat dataset
(global pair ``g`` to rank ``g % dp``), and the position is checkpointed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import Stateful

from torchtitan.data.chat_data import StridedRows
from torchtitan.data.chat_template import ChatTokenizer, Message, tokenize_conversation
from torchtitan.data.checks import DataError
from torchtitan.loss.cross_entropy import IGNORE_INDEX

Side = tuple[np.ndarray, np.ndarray]  # inputs, labels (unpadded)
FIELD = "dpo.dataset_path"


def _records(path: Path, field: str = FIELD) -> Iterator[tuple[int, Any]]:
    if path.is_dir():  # a Hugging Face dataset saved with save_to_disk
        import datasets

        yield from enumerate(datasets.load_from_disk(str(path)))
        return
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                try:
                    yield lineno, json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(
                        field, str(path), f"not JSON ({e.msg})", "fix the record", path, lineno
                    ) from None


def _messages(value: Any, role: str) -> list[Message]:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list) and all(isinstance(m, dict) for m in value):
        return [
            {"role": str(m.get("role", role)), "content": str(m.get("content", ""))} for m in value
        ]
    raise ValueError(f"expected a string or a list of messages, got {type(value).__name__}")


def tokenize_pair(
    record: Any, tokenizer: ChatTokenizer, seq_len: int, template: str | None = None
) -> tuple[Side, Side]:
    """(inputs, labels) of the chosen and the rejected side; ``ValueError`` with the rule."""
    if not isinstance(record, dict) or not {"prompt", "chosen", "rejected"} <= set(record):
        raise ValueError('expected an object with "prompt", "chosen" and "rejected"')
    prompt = _messages(record["prompt"], "user")
    prompt_ids, _ = tokenize_conversation(tokenizer, prompt, template)
    if len(prompt_ids) >= seq_len:
        raise ValueError(
            f"the prompt is {len(prompt_ids)} tokens, leaving no room for a completion in "
            f"training.seq_len = {seq_len}"
        )
    sides = []
    for name in ("chosen", "rejected"):
        completion = _messages(record[name], "assistant")
        if not any(m["content"].strip() for m in completion):
            raise ValueError(f"the {name} side is empty")
        ids, train = tokenize_conversation(tokenizer, prompt + completion, template)
        if ids[: len(prompt_ids)] != prompt_ids:
            raise ValueError("the chat template does not render the prompt as a prefix")
        ids = ids[: seq_len + 1]
        tokens = np.asarray(ids, dtype=np.int64)
        trained = np.asarray(train[1 : len(ids)], dtype=bool)
        trained[: len(prompt_ids) - 1] = False  # the prompt is never trained on
        if not trained.any():
            raise ValueError(
                f"the prompt leaves no room for the {name} completion in training.seq_len = "
                f"{seq_len} (after the chat template's turn markers)"
            )
        sides.append((tokens[:-1], np.where(trained, tokens[1:], IGNORE_INDEX)))
    return sides[0], sides[1]


def _pad(side: Side, seq_len: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    inputs = np.full(seq_len, pad_id, dtype=np.int64)
    labels = np.full(seq_len, IGNORE_INDEX, dtype=np.int64)
    inputs[: len(side[0])], labels[: len(side[1])] = side
    return torch.from_numpy(inputs), torch.from_numpy(labels)


class PreferenceDataset(StridedRows, IterableDataset, Stateful):
    """Rows ``(chosen_inputs, chosen_labels, rejected_inputs, rejected_labels)`` of one
    data-parallel rank, each ``[seq_len]``; see the module docstring."""

    state_key = "next_pair"

    def __init__(
        self,
        path: str | Path,
        tokenizer: ChatTokenizer,
        seq_len: int,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        template: str | None = None,
        infinite: bool = True,
        field: str = FIELD,
    ) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise DataError(
                field,
                str(path),
                "no such file or folder",
                "point it at a JSONL file or a saved dataset",
            )
        self.seq_len, self.pad_id, self.infinite = seq_len, tokenizer.eos_id, infinite
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.pairs: list[tuple[Side, Side]] = []
        for where, record in _records(self.path, field):
            try:
                self.pairs.append(tokenize_pair(record, tokenizer, seq_len, template))
            except ValueError as e:
                raise DataError(
                    field,
                    str(path),
                    f"preference record: {e}",
                    "fix or remove the record",
                    self.path,
                    where,
                ) from None
        if not self.pairs:
            raise DataError(field, str(path), "no preference pair", "add records", self.path)
        self._next, self._resume = 0, None

    def __len__(self) -> int:
        return len(self.pairs)

    def row(self, index: int) -> tuple[torch.Tensor, ...]:
        chosen, rejected = self.pairs[index]
        return (
            *_pad(chosen, self.seq_len, self.pad_id),
            *_pad(rejected, self.seq_len, self.pad_id),
        )


def preference_batches(
    ds: PreferenceDataset, batch_size: int
) -> Iterator[tuple[torch.Tensor, ...]]:
    """Microbatches of ``batch_size`` pairs: four ``[batch_size, seq_len]`` tensors."""
    rows = iter(ds)
    while True:
        chunk = [next(rows) for _ in range(batch_size)]
        yield tuple(torch.stack(col) for col in zip(*chunk, strict=True))
