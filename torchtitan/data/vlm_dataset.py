"""Image-text samples for vision-language training (docs/vlm.md, "Data").

Sources, local files only:

* parquet: a ``text`` column and the images' encoded bytes in ``images`` (a list per row) or
  ``image`` (one per row; either may also be a struct with a ``bytes`` field, the Hugging Face
  datasets layout);
* WebDataset tar shards: members grouped by key (the name up to the first dot); the images are
  the members with an image extension (in name order), the text the ``.txt`` member (or the
  ``text`` of a ``.json`` one).

In the text each ``<image>`` marks where an image goes; it becomes ``t * h * w / merge**2``
placeholder ids (``image_token_id``; between ``vision_start_id`` and ``vision_end_id`` when
those are set), the tokens the vision tower's output replaces. Labels: the next token, ignored
(-100) where that token is a placeholder or padding. A sample whose image cannot be decoded or
is too large is skipped and counted (one warning per reason, then only the counts); a sample
with more ``<image>`` markers than images (or fewer) is an error naming it.
"""

from __future__ import annotations

import json
import tarfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import IterableDataset

from torchtitan.data.tokenizer import TextTokenizer
from torchtitan.data.vlm_images import BadImage, ImageRules
from torchtitan.data.vlm_navit import NavitRules
from torchtitan.loss.chunked import IGNORE_INDEX
from torchtitan.tools.logging import logger

MARKER = "<image>"
IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif")

Raw = tuple[str, str, list[bytes]]
"""(sample name for messages, text with markers, encoded images)."""


@dataclass(frozen=True)
class ImageTokens:
    image_token_id: int
    vision_start_id: int | None = None
    vision_end_id: int | None = None


@dataclass
class VLMSample:
    inputs: torch.Tensor  # [S]
    labels: torch.Tensor  # [S]
    pixel_values: torch.Tensor  # [patches, patch_dim]
    grid_thw: torch.Tensor  # [images, 3]


def _image_bytes(value: Any) -> bytes:
    return value["bytes"] if isinstance(value, dict) else value


def read_parquet(path: Path) -> Iterator[Raw]:
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    names = set(table.column_names)
    if "text" not in names or not names & {"images", "image"}:
        raise ValueError(
            f"{path}: columns {sorted(names)}; an image-text parquet needs 'text' and 'images' "
            "(a list of encoded images) or 'image'"
        )
    column = "images" if "images" in names else "image"
    for i, row in enumerate(table.select(["text", column]).to_pylist()):
        imgs = row[column]
        imgs = [] if imgs is None else imgs if column == "images" else [imgs]
        yield f"{path} row {i}", row["text"] or "", [_image_bytes(b) for b in imgs]


def read_tar(path: Path) -> Iterator[Raw]:
    groups: dict[str, dict[str, bytes]] = {}
    with tarfile.open(path) as tar:
        for member in tar:
            if not member.isfile():
                continue
            base = member.name.rsplit("/", 1)[-1]
            key = member.name[: len(member.name) - len(base)] + base.split(".", 1)[0]
            f = tar.extractfile(member)
            if f is not None:
                groups.setdefault(key, {})[base.split(".", 1)[-1].lower()] = f.read()
    for key, parts in groups.items():
        if "txt" in parts:
            text = parts["txt"].decode("utf-8")
        elif "json" in parts:
            text = json.loads(parts["json"]).get("text", "")
        else:
            text = ""
        images = [parts[ext] for ext in sorted(parts) if "." + ext.rsplit(".", 1)[-1] in IMAGE_EXTS]
        yield f"{path}:{key}", text, images


def read_source(path: Path) -> Iterator[Raw]:
    if path.suffix == ".parquet":
        return read_parquet(path)
    if path.suffix == ".tar":
        return read_tar(path)
    raise ValueError(f"{path}: an image-text source must be a .parquet file or a .tar shard")


def source_files(path: Path) -> list[Path]:
    """The ``.parquet`` and ``.tar`` files of ``path`` (itself, or a folder's, sorted);
    ``ValueError`` when there are none."""
    files = (
        sorted(p for p in path.iterdir() if p.suffix in (".parquet", ".tar"))
        if path.is_dir()
        else [path]
    )
    if not files or not all(p.is_file() and p.suffix in (".parquet", ".tar") for p in files):
        raise ValueError("must be a .parquet file, a .tar shard or a folder holding them")
    return files


Rules = ImageRules | NavitRules
"""How a tower's images become patches: Qwen-VL's (``vlm_images.py``) or MoonViT's
(``vlm_navit.py``)."""


def tokenize(
    raw: Raw, tokenizer: TextTokenizer, rules: Rules, ids: ImageTokens
) -> tuple[list[int], torch.Tensor, list[tuple[int, int, int]]]:
    """(token ids with placeholders, pixel values, grids); :class:`BadImage` for an image to
    skip, ``ValueError`` when markers and images do not pair up."""
    name, text, images = raw
    pieces = text.split(MARKER)
    if len(pieces) - 1 != len(images):
        raise ValueError(
            f"sample {name}: {len(pieces) - 1} {MARKER} placeholders but {len(images)} images; "
            f"put one {MARKER} in the text where each image goes"
        )
    patches, grids = [], []
    for data in images:
        px, grid = rules.encode(data)
        patches.append(px)
        grids.append(grid)
    tokens = tokenizer.encode(pieces[0], bos=True, eos=False)
    for piece, grid in zip(pieces[1:], grids, strict=True):
        tokens += [ids.vision_start_id] if ids.vision_start_id is not None else []
        tokens += [ids.image_token_id] * rules.tokens(grid)
        tokens += [ids.vision_end_id] if ids.vision_end_id is not None else []
        tokens += tokenizer.encode(piece, bos=False, eos=False)
    tokens.append(tokenizer.eos_id)
    pixels = torch.cat(patches) if patches else torch.zeros(0, rules.patch_dim)
    return tokens, pixels, grids


class VLMDataset(IterableDataset):
    """One sample per row of ``seq_len`` tokens (padded; text past the end cut; a sample whose
    images do not fit skipped and counted); sample ``i`` of the sources, in order, belongs to
    data-parallel rank ``i % dp_world``; ``infinite``: epoch after epoch."""

    def __init__(
        self,
        paths: Sequence[Path],
        tokenizer: TextTokenizer,
        seq_len: int,
        rules: Rules,
        ids: ImageTokens,
        dp_rank: int = 0,
        dp_world: int = 1,
        infinite: bool = False,
    ) -> None:
        self.paths, self.tokenizer, self.seq_len = list(paths), tokenizer, seq_len
        self.rules, self.ids = rules, ids
        self.dp_rank, self.dp_world, self.infinite = dp_rank, dp_world, infinite
        self.skipped: dict[str, int] = {}

    def _skip(self, reason: str, name: str, detail: str) -> None:
        if reason not in self.skipped:
            logger.warning(f"skipping sample {name}: {detail} (further '{reason}' skips counted)")
        self.skipped[reason] = self.skipped.get(reason, 0) + 1

    def __iter__(self) -> Iterator[VLMSample]:
        while True:
            yielded = False
            for sample in self._epoch():
                yielded = True
                yield sample
            if not (self.infinite and yielded):
                return

    def _epoch(self) -> Iterator[VLMSample]:
        index = 0
        for path in self.paths:
            for raw in read_source(Path(path)):
                index += 1
                if (index - 1) % self.dp_world != self.dp_rank:
                    continue
                sample = self._sample(raw)
                if sample is not None:
                    yield sample

    def _sample(self, raw: Raw) -> VLMSample | None:
        try:
            tokens, pixels, grids = tokenize(raw, self.tokenizer, self.rules, self.ids)
        except BadImage as e:
            self._skip("bad image", raw[0], str(e))
            return None
        window = self.seq_len + 1
        if self.ids.image_token_id in tokens[window:]:
            self._skip("too long", raw[0], f"its images need more than seq_len={self.seq_len}")
            return None
        tokens = tokens[:window]
        t = torch.full((window,), self.tokenizer.eos_id, dtype=torch.long)
        t[: len(tokens)] = torch.tensor(tokens)
        labels = t[1:].clone()
        labels[labels == self.ids.image_token_id] = IGNORE_INDEX
        labels[len(tokens) - 1 :] = IGNORE_INDEX  # padding
        grid = torch.tensor(grids, dtype=torch.long).view(-1, 3)
        return VLMSample(t[:-1], labels, pixels, grid)


def collate(samples: list[VLMSample]) -> dict[str, torch.Tensor]:
    """A batch: ``inputs``/``labels`` ``[B, S]``, the images of all rows in order
    (``pixel_values``, ``grid_thw``)."""
    return {
        "inputs": torch.stack([s.inputs for s in samples]),
        "labels": torch.stack([s.labels for s in samples]),
        "pixel_values": torch.cat([s.pixel_values for s in samples]),
        "grid_thw": torch.cat([s.grid_thw for s in samples]),
    }
