"""Image-text samples mixed with text data at weights (docs/vlm.md, "Data"): a
``[[training.mixture]]`` table with ``dataset = "vlm"`` is an image-text source beside the
text and pre-tokenized ones, interleaved by ``data/mixture.py``'s deterministic weighted order.

A row of the batch is one window of one source: an image-text sample (padded, placeholders and
padding masked, its patches) or ``seq_len + 1`` packed text tokens (every label a target, no
patches; their MRoPE positions are then plain RoPE). Window ``c`` of an image-text source is its
raw sample ``c`` (epoch after epoch, by ``training.mixture_exhausted``) read by random access
(:class:`RawIndex`), so a rank decodes only its own rows and the rows do not depend on the
data-parallel degree; a sample that is skipped (bad image, too long: counted) gives way to the
next usable sample after it. The source keeps no state of its own: the mixture's counts bring a
resumed loader to the same next batch.
"""

from __future__ import annotations

import bisect
import tarfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch

from torchtitan.data.mixture import MixtureDataset, WindowSource, _run_out
from torchtitan.data.vlm_dataset import (
    Raw,
    VLMDataset,
    VLMSample,
    member_bytes,
    parquet_rows,
    tar_groups,
    tar_raw,
)
from torchtitan.tools.logging import logger

__all__ = ["ImageTextSource", "RawIndex", "VLMMixtureDataset"]


class _Parquet:
    """A parquet file's rows by index, one row group in memory at a time."""

    def __init__(self, path: Path) -> None:
        self.path, self.file = path, pq.ParquetFile(path)
        sizes = [self.file.metadata.row_group(g).num_rows for g in range(self.file.num_row_groups)]
        self.starts = np.cumsum([0, *sizes]).tolist()
        self._group: tuple[int, list[Raw]] | None = None
        parquet_rows(path, self.file.schema_arrow.empty_table(), 0)  # the columns' check

    def __len__(self) -> int:
        return int(self.starts[-1])

    def raw(self, i: int) -> Raw:
        g = bisect.bisect_right(self.starts, i) - 1
        if self._group is None or self._group[0] != g:
            table = self.file.read_row_group(g)
            self._group = (g, parquet_rows(self.path, table, self.starts[g]))
        return self._group[1][i - self.starts[g]]


class _Tar:
    """A WebDataset shard's samples by index (members read by their offsets)."""

    def __init__(self, path: Path) -> None:
        self.path, self.groups = path, list(tar_groups(path).items())

    def __len__(self) -> int:
        return len(self.groups)

    def raw(self, i: int) -> Raw:
        key, members = self.groups[i]
        with tarfile.open(self.path) as tar:
            parts = {ext: member_bytes(tar, m) for ext, m in members.items()}
        return tar_raw(f"{self.path}:{key}", parts)


class RawIndex:
    """The raw samples of image-text files (parquet, tar), in the files' order, by index."""

    def __init__(self, paths: Sequence[Path]) -> None:
        self.files = [_Parquet(p) if p.suffix == ".parquet" else _Tar(p) for p in paths]
        self.starts = np.cumsum([0, *(len(f) for f in self.files)]).tolist()

    def __len__(self) -> int:
        return int(self.starts[-1])

    def raw(self, i: int) -> Raw:
        f = bisect.bisect_right(self.starts, i) - 1
        return self.files[f].raw(i - self.starts[f])


class ImageTextSource:
    """A mixture source of image-text samples: window ``c`` is raw sample ``c mod n`` (or,
    when that one is skipped, the next usable one after it)."""

    sequential = False

    def __init__(self, name: str, index: RawIndex, builder: VLMDataset, exhausted: str) -> None:
        if len(index) == 0:
            raise ValueError(f"image-text source {name!r} holds no sample")
        self.name, self.index, self.builder, self.exhausted = name, index, builder, exhausted

    def window(self, c: int) -> VLMSample:
        n = len(self.index)
        epoch = c // n
        if epoch > 0 and self.exhausted == "error":
            raise _run_out(self.name, c)
        if epoch > 0 and c % n == 0:
            logger.info(f"mixture source {self.name!r}: epoch {epoch} starts at its window {c}")
        for k in range(n):
            sample = self.builder.sample(self.index.raw((c + k) % n))
            if sample is not None:
                return sample
        raise ValueError(
            f"image-text source {self.name!r}: none of its {n} samples can be used "
            f"(skipped: {self.builder.skipped}); fix the data or raise training.seq_len"
        )

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class VLMMixtureDataset(MixtureDataset):
    """A mixture whose rows are :class:`VLMSample`: text windows become samples without
    images (batched by ``vlm_dataset.py: collate``)."""

    def __init__(self, sources: list[WindowSource], weights: list[float], seq_len: int,
                 patch_dim: int, dp_rank: int = 0, dp_world_size: int = 1) -> None:  # fmt: skip
        super().__init__(sources, weights, seq_len, dp_rank, dp_world_size)
        self.patch_dim = patch_dim

    def _item(self, window: Any) -> VLMSample:
        if isinstance(window, VLMSample):
            return window
        t = torch.from_numpy(np.ascontiguousarray(window[0], dtype=np.int64))
        return VLMSample(
            t[:-1], t[1:], torch.zeros(0, self.patch_dim), torch.zeros(0, 3, dtype=torch.long)
        )

    def skipped(self) -> dict[str, int]:
        """The samples each image-text source skipped on this rank, by reason."""
        return {
            f"{s.name}: {reason}": n
            for s in self.sources
            if isinstance(s, ImageTextSource)
            for reason, n in s.builder.skipped.items()
        }
