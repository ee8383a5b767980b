"""One data loader for any ``training.dataset``: text, ``tokenized``, ``mixture`` or another
kind registered in ``DATASET_KINDS`` (docs/data.md). Text datasets go to
``dataloader.build_dataloader`` unchanged."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from torch.utils.data import IterableDataset

from torchtitan.config.job_config import MixtureSource
from torchtitan.data.dataloader import (
    PackedTokenDataset,
    ParallelAwareDataloader,
    build_dataloader,
)
from torchtitan.data.mixture import MixtureDataset, Source, TextSource, TokenizedSource
from torchtitan.data.sources import Fields, load_text_dataset, local_source
from torchtitan.data.token_shards import MANIFEST, TokenCorpus
from torchtitan.data.tokenized_dataset import Shuffle, TokenizedDataset, WindowOrder
from torchtitan.data.tokenizer import AnyTokenizer
from torchtitan.tools.paths import resolve_repo_path

__all__ = [
    "DATASET_KINDS",
    "DataOptions",
    "LoaderRequest",
    "build_data_loader",
    "is_token_corpus",
    "mixture_source",
    "source_label",
]


@dataclass
class DataOptions:
    """The pre-tokenized and mixture options of ``[training]``."""

    shuffle: Shuffle = "none"
    seed: int = 0
    mixture: list[MixtureSource] = field(default_factory=list)
    mixture_exhausted: Literal["wrap", "error"] = "wrap"


def is_token_corpus(path: str) -> bool:
    """Whether ``path`` is a corpus folder of scripts/pretokenize.py."""
    return bool(path) and (resolve_repo_path(path) / MANIFEST).is_file()


def source_label(source: MixtureSource) -> str:
    """The name a mixture source has in logs and metrics: its dataset, else (and for an
    image-text source, ``dataset = "vlm"``) its path's name."""
    if source.dataset and source.dataset != "vlm":
        return source.dataset
    return Path(source.path.rstrip("/")).name


def mixture_source(
    i: int, src: MixtureSource, tokenizer: AnyTokenizer, seq_len: int, opts: DataOptions
) -> Source:
    """Source ``i`` of the mixture; its errors name ``training.mixture[i]``'s fields."""
    name, fields = source_label(src), Fields.mixture(i)
    if is_token_corpus(src.path):
        corpus = TokenCorpus(resolve_repo_path(src.path), tokenizer, fields.path)
        order = WindowOrder(corpus, seq_len + 1, opts.shuffle, opts.seed)
        return TokenizedSource(name, order, opts.mixture_exhausted)
    text = (src.dataset or src.path, src.path or None, "train", fields)
    hf, column = load_text_dataset(*text)
    packed = PackedTokenDataset(
        hf,
        tokenizer,
        seq_len,
        infinite=opts.mixture_exhausted == "wrap",
        text_column=column,
        name=name,
        source=local_source(*text),
    )
    return TextSource(name, packed, tokenizer.eos_id)


@dataclass(frozen=True)
class LoaderRequest:
    """What a kind of dataset is built from: one data-parallel rank's view of the config."""

    dataset: str
    dataset_path: str | None
    tokenizer: AnyTokenizer
    seq_len: int
    dp_rank: int
    dp_world_size: int
    split: str
    infinite: bool
    with_doc_ids: bool
    options: DataOptions


def _path_field(split: str) -> str:
    return "validation.dataset_path" if split == "validation" else "training.dataset_path"


def _tokenized(req: LoaderRequest) -> TokenizedDataset:
    if not req.dataset_path:
        raise ValueError('dataset "tokenized" needs dataset_path (a pretokenized corpus)')
    return TokenizedDataset(
        TokenCorpus(resolve_repo_path(req.dataset_path), req.tokenizer, _path_field(req.split)),
        req.seq_len,
        req.dp_rank,
        req.dp_world_size,
        shuffle=req.options.shuffle,
        seed=req.options.seed,
        infinite=req.infinite,
        with_doc_ids=req.with_doc_ids,
        name=req.dataset_path,
    )


def _mixture(req: LoaderRequest) -> MixtureDataset:
    opts = req.options
    return MixtureDataset(
        [
            mixture_source(i, s, req.tokenizer, req.seq_len, opts)
            for i, s in enumerate(opts.mixture)
        ],
        [s.weight for s in opts.mixture],
        req.seq_len,
        req.dp_rank,
        req.dp_world_size,
        with_doc_ids=req.with_doc_ids,
    )


# ``training.dataset`` values that are not text datasets -> the dataset of one rank. A new kind
# of data (e.g. chat conversations) registers its builder here (docs/data.md).
DATASET_KINDS: dict[str, Callable[[LoaderRequest], IterableDataset]] = {
    "tokenized": _tokenized,
    "mixture": _mixture,
}


def build_data_loader(
    dataset: str,
    dataset_path: str | None,
    tokenizer: AnyTokenizer,
    seq_len: int,
    local_batch_size: int,
    dp_rank: int,
    dp_world_size: int,
    split: str = "train",
    infinite: bool = True,
    sharding: Literal["window", "document"] = "window",
    with_doc_ids: bool = False,
    options: DataOptions | None = None,
) -> ParallelAwareDataloader:
    """The loader of ``(inputs, labels[, doc_ids])`` batches of this data-parallel rank: a kind
    of ``DATASET_KINDS``, else a text dataset (``dataloader.build_dataloader``)."""
    if dataset in DATASET_KINDS:
        req = LoaderRequest(
            dataset, dataset_path, tokenizer, seq_len, dp_rank, dp_world_size, split,
            infinite, with_doc_ids, options or DataOptions(),
        )  # fmt: skip
        data = DATASET_KINDS[dataset](req)
        return ParallelAwareDataloader(data, dp_rank, dp_world_size, batch_size=local_batch_size)
    return build_dataloader(
        dataset,
        dataset_path,
        tokenizer,
        seq_len,
        local_batch_size,
        dp_rank,
        dp_world_size,
        split=split,
        infinite=infinite,
        sharding=sharding,
        with_doc_ids=with_doc_ids,
    )
