"""Text datasets -> packed token windows -> a stateful, data-parallel-aware dataloader.

Flow: :func:`load_text_dataset` opens a streaming Hugging Face ``IterableDataset`` (a registered
name, a local file/directory, or a hub id); :class:`PackedTokenDataset` tokenizes each document as
``BOS text EOS``, concatenates them, cuts the stream into windows of ``seq_len + 1`` tokens and
keeps this data-parallel rank's share, yielding ``(window[:-1], window[1:])``;
:class:`ParallelAwareDataloader` batches the windows and checkpoints the exact data position of
its rank. Nothing here touches the network unless a hub dataset is requested.

Two ways to share the data among data-parallel ranks (``training.data_sharding``):

- ``window`` (default): every rank reads and tokenizes the whole stream and keeps windows
  ``i`` with ``i % dp == dp_rank``. The global batch of step ``s`` is then windows
  ``[s*G, (s+1)*G)`` whatever the data-parallel degree and gradient accumulation, so a run on N
  ranks sees exactly the data of a one-process run, and a checkpoint's data position is valid at
  any data-parallel size. The cost is that each rank tokenizes all documents.
- ``document``: documents (whole files where the dataset has enough of them) are split among
  ranks with ``datasets.distributed.split_dataset_by_node``; each rank tokenizes only its share,
  which scales to very large data-parallel degrees, but the data depends on that degree.
"""

from __future__ import annotations

import copy
import logging
import pickle
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import Stateful, StatefulDataLoader

from torchtitan.data.checks import DataError, DataSource, data_error
from torchtitan.data.sources import Fields, load_text_dataset, local_source
from torchtitan.data.tokenizer import TextTokenizer

if TYPE_CHECKING:  # ``datasets`` (pandas, pyarrow) is imported when a text dataset is opened
    from datasets import IterableDataset as HFIterableDataset

__all__ = [
    "document_ids",
    "PackedTokenDataset",
    "ParallelAwareDataloader",
    "build_dataloader",
]

logger = logging.getLogger(__name__)


def document_ids(inputs: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Document index of every token of packed windows ``inputs`` (``[..., S]``): int32, 0 for
    the window's first (possibly partial) document, one more after every EOS token."""
    after_eos = torch.zeros_like(inputs, dtype=torch.int32)
    after_eos[..., 1:] = (inputs[..., :-1] == eos_id).to(torch.int32)
    return after_eos.cumsum(dim=-1, dtype=torch.int32)


class PackedTokenDataset(IterableDataset, Stateful):
    """Tokenized, packed ``(inputs, labels)`` windows: this data-parallel rank's share.

    Each document becomes ``[BOS, *tokens, EOS]``; documents are concatenated and cut into
    non-overlapping windows of ``seq_len + 1`` tokens; a window ``w`` yields ``(w[:-1], w[1:])``
    as int64 tensors of length ``seq_len``. With ``infinite=True`` the data is repeated epoch
    after epoch, in the same order each time (the token buffer carries over, so no tokens are
    dropped at an epoch boundary); with ``infinite=False`` one pass is made and a final partial
    window is dropped. Each new ``iter()`` starts from the beginning unless a state was loaded.

    Resume is exact: the state is the Hugging Face dataset's own position, the leftover tokens,
    the epoch and the window count, so a restored dataset yields exactly the windows the
    original would have. ``sharding`` is described in the module docstring.

    With ``with_doc_ids`` each item is ``(inputs, labels, doc_ids)``: ``doc_ids`` (int32,
    :func:`document_ids`) are computed from the window itself, so the resume state is unchanged.
    """

    def __init__(
        self,
        hf_dataset: HFIterableDataset,
        tokenizer: TextTokenizer,
        seq_len: int,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        infinite: bool = True,
        text_column: str = "text",
        name: str = "dataset",
        sharding: Literal["window", "document"] = "window",
        with_doc_ids: bool = False,
        source: DataSource | None = None,
    ) -> None:
        self.source = source  # names the field and files in data errors
        if seq_len < 1:
            raise ValueError(f"training.seq_len must be >= 1, got {seq_len}")
        self.name, self.seq_len, self.infinite = name, seq_len, infinite
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.text_column = text_column
        self._tokenizer = tokenizer
        self.sharding = sharding
        self.with_doc_ids = with_doc_ids
        if sharding == "document":
            from datasets.distributed import split_dataset_by_node

            self._data = split_dataset_by_node(hf_dataset, rank=dp_rank, world_size=dp_world_size)
        else:
            self._data = hf_dataset
        self._fresh_hf_state = self._data.state_dict()  # position 0 of epoch 0
        self._buffer: list[int] = []
        self._epoch = 0
        self._windows = 0  # windows cut from the stream so far (window sharding: a global count)
        self._pending: dict[str, Any] | None = None  # loaded, applied when iteration starts

    def _documents(self) -> Iterator[str]:
        it = iter(self._data)
        while True:
            try:
                example = next(it)
            except StopIteration:
                return
            except Exception as e:  # a reader's error (invalid JSON, ...): name file and line
                raise data_error(self.source, e) from e
            if self.text_column not in example:
                field = self.source.field if self.source else "training.dataset"
                raise DataError(
                    field,
                    self.source.value if self.source else self.name,
                    f"a record has no {self.text_column!r} column (columns: {sorted(example)})",
                    f"give every record a {self.text_column!r} field",
                )
            text = example[self.text_column]
            if not isinstance(text, str):  # a record without it (the reader filled in None)
                raise data_error(
                    self.source,
                    TypeError(f"a record's {self.text_column!r} is {type(text).__name__}"),
                )
            yield text

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        if self._pending is not None:
            state, self._pending = self._pending, None
            self._epoch, self._buffer = state["epoch"], list(state["buffer"])
            self._windows = state.get("windows", 0)
            hf_state = state["hf"]
        else:  # a new iteration starts from the beginning
            self._epoch, self._buffer, hf_state = 0, [], self._fresh_hf_state
            self._windows = 0
        # Epochs are counted here, not with the HF dataset's `set_epoch`: its epoch lives in
        # shared memory across DataLoader workers (meant to be set from the main process), so
        # workers moving to their next epoch at different times would race on it and make the
        # data order nondeterministic. The HF epoch stays 0 and every pass starts by loading a
        # position: HF re-applies a loaded state to every later pass with the same epoch
        # number, so the fresh (start) position is loaded explicitly when not resuming.
        fresh = hf_state is self._fresh_hf_state
        self._data.load_state_dict(hf_state)
        window = self.seq_len + 1
        mine: list[int] = []
        first_pass = True
        while True:
            n_docs = 0
            for text in self._documents():
                n_docs += 1
                self._buffer.extend(self._tokenizer.encode(text, bos=True, eos=True))
                while len(self._buffer) >= window:
                    chunk, self._buffer = self._buffer[:window], self._buffer[window:]
                    index, self._windows = self._windows, self._windows + 1
                    if self.sharding == "window":
                        # Window i belongs to rank i % dp. Keep ours and yield it when the
                        # round of dp windows is complete, so every rank's saved position is
                        # the same round boundary (a global position, valid at any dp size).
                        if index % self.dp_world_size == self.dp_rank:
                            mine = chunk
                        if index % self.dp_world_size != self.dp_world_size - 1:
                            continue
                        chunk = mine
                    tokens = torch.tensor(chunk, dtype=torch.int64)
                    if self.with_doc_ids:
                        inputs = tokens[:-1]
                        yield inputs, tokens[1:], document_ids(inputs, self._tokenizer.eos_id)
                    else:
                        yield tokens[:-1], tokens[1:]
            in_main = torch.utils.data.get_worker_info() is None  # workers may get no files
            if n_docs == 0 and first_pass and fresh and self.sharding == "window" and in_main:
                src = self.source
                raise DataError(
                    src.field if src else "training.dataset",
                    src.value if src else self.name,
                    f"holds no records for split {self._split_name()}",
                    "point it at a non-empty file or directory",
                    ", ".join(str(p) for p in src.files[:3]) if src and src.files else None,
                )
            if not self.infinite:
                return
            if n_docs == 0 and not first_pass:  # (a resumed pass may start at its very end)
                worker = torch.utils.data.get_worker_info()
                logger.warning(
                    "dataset %r: dp rank %d%s got no documents in epoch %d and stops. Either "
                    "its data is empty, or there are more dataloader workers than data files "
                    "per rank (%d files after data-parallel sharding): `datasets` gives each "
                    "worker whole files.",
                    self.name,
                    self.dp_rank,
                    f" worker {worker.id}" if worker is not None else "",
                    self._epoch,
                    self._data.num_shards,
                )
                return
            first_pass = False
            self._epoch += 1
            self._data.load_state_dict(self._fresh_hf_state)
            logger.info(
                "dataset %r: dp rank %d finished a pass over its data; starting epoch %d",
                self.name,
                self.dp_rank,
                self._epoch,
            )

    def _split_name(self) -> str:
        return repr(getattr(self._data, "split", None) or "?")

    def state_dict(self) -> dict[str, Any]:
        if self._pending is not None:
            return copy.deepcopy(self._pending)
        return {
            "hf": self._data.state_dict(),
            "buffer": list(self._buffer),
            "epoch": self._epoch,
            "windows": self._windows,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        missing = {"hf", "buffer", "epoch"} - set(state_dict)
        if missing:
            raise ValueError(f"dataset {self.name!r}: state is missing {sorted(missing)}")
        self._pending = copy.deepcopy(state_dict)


class ParallelAwareDataloader(StatefulDataLoader):
    """A ``StatefulDataLoader`` whose checkpoint state names its data-parallel rank.

    ``state_dict()`` returns ``{"dp_rank_<r>": <pickled loader state>, "dp_world_size": W}``.
    Each rank has its own key, so the states of all ranks can live side by side in one
    checkpoint; the loader state is pickled to ``bytes`` so a checkpointer such as DCP stores it
    as one opaque object whatever its nested structure. Loading a state saved with another
    data-parallel world size raises ``ValueError`` (the data position cannot be resharded yet);
    loading a state without this rank's key warns and starts from the beginning.
    """

    def __init__(
        self,
        dataset: IterableDataset,
        dp_rank: int,
        dp_world_size: int,
        batch_size: int,
        num_workers: int = 0,
        **kwargs: Any,
    ) -> None:
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank must be in [0, {dp_world_size}), got {dp_rank}")
        if batch_size < 1:
            raise ValueError(f"training.local_batch_size must be >= 1, got {batch_size}")
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self._rank_key = f"dp_rank_{dp_rank}"
        # Each iter() draws a base seed; from a private generator, so creating the iterator
        # does not advance torch's global RNG (whose state a checkpoint restores bitwise).
        kwargs.setdefault("generator", torch.Generator())
        with warnings.catch_warnings():
            # torchdata 0.11's StatefulDataLoader.__init__ itself calls torch.set_vital, which
            # torch >= 2.12 deprecates; no argument avoids that call. Only that warning, only
            # here (docs/errors.md: a run prints no warning its user did not cause).
            warnings.filterwarnings(
                "ignore", message="'set_vital' is deprecated", category=UserWarning
            )
            super().__init__(dataset, batch_size=batch_size, num_workers=num_workers, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        return {
            self._rank_key: pickle.dumps(super().state_dict()),
            "dp_world_size": self.dp_world_size,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            warnings.warn(
                f"dataloader: empty state for {self._rank_key}; starting from the beginning",
                stacklevel=2,
            )
            return
        saved_world = state_dict.get("dp_world_size")
        window_sharding = getattr(self.dataset, "sharding", None) == "window"
        if saved_world is not None and int(saved_world) != self.dp_world_size and window_sharding:
            # Window sharding saves the same global round boundary on every rank, so any
            # rank's position is valid for a new data-parallel size.
            any_key = sorted(k for k in state_dict if k.startswith("dp_rank_"))
            if not any_key:
                raise ValueError("dataloader: the checkpoint holds no dp_rank_<r> state")
            state_dict = {
                self._rank_key: state_dict[any_key[0]],
                "dp_world_size": self.dp_world_size,
            }
            saved_world = self.dp_world_size
        if saved_world is not None and int(saved_world) != self.dp_world_size:
            raise ValueError(
                f"dataloader: the checkpoint was saved with a data-parallel world size of "
                f"{saved_world}, this run has {self.dp_world_size}. With "
                f"training.data_sharding = 'document' the data position depends on the "
                f"data-parallel size: keep the same data_parallel_replicate_degree x "
                f"data_parallel_shard_degree, or train with data_sharding = 'window'."
            )
        if self._rank_key not in state_dict:
            warnings.warn(
                f"dataloader: the checkpoint has no state for {self._rank_key} (keys: "
                f"{sorted(state_dict)}); this rank's data starts from the beginning",
                stacklevel=2,
            )
            return
        inner = state_dict[self._rank_key]
        if isinstance(inner, (bytes, bytearray)):
            inner = pickle.loads(inner)
        super().load_state_dict(inner)


def build_dataloader(
    dataset: str,
    dataset_path: str | None,
    tokenizer: TextTokenizer,
    seq_len: int,
    local_batch_size: int,
    dp_rank: int,
    dp_world_size: int,
    split: str = "train",
    infinite: bool = True,
    num_workers: int = 0,
    sharding: Literal["window", "document"] = "window",
    with_doc_ids: bool = False,
) -> ParallelAwareDataloader:
    """A dataloader of ``(inputs, labels)`` int64 batches of shape ``[local_batch_size, seq_len]``
    over this data-parallel rank's share of ``dataset`` (see :func:`load_text_dataset`); with
    ``with_doc_ids``, ``(inputs, labels, doc_ids)`` with int32 document ids of the same shape."""
    if not 0 <= dp_rank < dp_world_size:
        raise ValueError(f"dp_rank must be in [0, {dp_world_size}), got {dp_rank}")
    fields = Fields.of("validation" if split == "validation" else "training")
    hf_dataset, text_column = load_text_dataset(dataset, dataset_path, split, fields)
    source = local_source(dataset, dataset_path, split, fields)
    packed = PackedTokenDataset(
        hf_dataset,
        tokenizer,
        seq_len,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        infinite=infinite,
        text_column=text_column,
        name=dataset,
        sharding=sharding,
        with_doc_ids=with_doc_ids,
        source=source,
    )
    return ParallelAwareDataloader(
        packed, dp_rank, dp_world_size, batch_size=local_batch_size, num_workers=num_workers
    )
