"""Image-text samples for vision-language training (docs/vlm.md, "Data").

Sources, local files only:

* parquet: a ``text`` column (or a chat ``messages`` one) and the images' encoded bytes in
  ``images`` (a list per row) or ``image`` (one per row; either may also be a struct with a
  ``bytes`` field, the Hugging Face datasets layout);
* WebDataset tar shards: members grouped by key (the name up to the first dot); the images are
  the members with an image extension (in name order), the text the ``.txt`` member (or the
  ``messages`` or ``text`` of a ``.json`` one).

**Chat samples**: ``messages``, a list of ``{"role", "content"}`` turns whose content is a
string (``<image>`` where an image goes, the LLaVA convention) or a list of parts
``{"type": "image"}`` / ``{"type": "text", "text": ...}`` (the Hugging Face datasets' layout).
They are rendered as the chat SFT data renders them (``data/chat_template.py``: the tokenizer's
Jinja template, else the default one) and train on the assistant turns only (content and
end-of-turn tokens); an image's placeholders never train.

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
from typing import Any, cast

import torch
from torch.utils.data import IterableDataset

from torchtitan.data.chat_template import (
    ChatTokenizer,
    _default_pieces,
    _encode_with_specials,
    _jinja_pieces,
    validate_conversation,
)
from torchtitan.data.tokenizer import TextTokenizer
from torchtitan.data.vlm_images import BadImage, ImageRules, NavitRules
from torchtitan.loss.chunked import IGNORE_INDEX
from torchtitan.tools.logging import logger

MARKER = "<image>"
IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif")

Message = dict[str, str]
Raw = tuple[str, str | list[Any], list[bytes]]
"""(sample name for messages, text with markers or a chat ``messages`` list, encoded
images)."""


@dataclass(frozen=True)
class ImageTokens:
    image_token_id: int
    vision_start_id: int | None = None
    vision_end_id: int | None = None


def image_tokens(model_args: Any) -> ImageTokens:
    """The placeholder ids of the model a run builds (its flavor, or the args read from a
    ``config.json``): one source for the model and the data. ``vision_start_token_id`` /
    ``vision_end_token_id`` wrap each image when both are token ids of its vocabulary (the
    debug flavors' lie outside their 2048 tokens: their images are not wrapped)."""
    vocab = model_args.vocab_size
    start = getattr(model_args, "vision_start_token_id", None)
    end = getattr(model_args, "vision_end_token_id", None)
    if start is None or end is None or not (0 <= start < vocab and 0 <= end < vocab):
        start = end = None
    return ImageTokens(model_args.image_token_id, start, end)


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

    yield from parquet_rows(path, pq.read_table(path), 0)


def parquet_rows(path: Path, table: Any, first: int) -> list[Raw]:
    """The samples of ``table`` (a parquet file's rows from row ``first``); ``ValueError``
    without the columns."""
    names = set(table.column_names)
    if not names & {"text", "messages"} or not names & {"images", "image"}:
        raise ValueError(
            f"{path}: columns {sorted(names)}; an image-text parquet needs 'text' (or a chat "
            "'messages' list) and 'images' (a list of encoded images) or 'image'"
        )
    text = "messages" if "messages" in names else "text"
    column = "images" if "images" in names else "image"
    out: list[Raw] = []
    for i, row in enumerate(table.select([text, column]).to_pylist()):
        imgs = row[column]
        imgs = [] if imgs is None else imgs if column == "images" else [imgs]
        words = row[text] if text == "messages" else row[text] or ""
        out.append((f"{path} row {first + i}", words, [_image_bytes(b) for b in imgs]))
    return out


def tar_groups(path: Path) -> dict[str, dict[str, tarfile.TarInfo]]:
    """The members of a WebDataset shard by sample key (the name up to the first dot), each
    by its extension, in the shard's order."""
    groups: dict[str, dict[str, tarfile.TarInfo]] = {}
    with tarfile.open(path) as tar:
        for member in tar:
            if not member.isfile():
                continue
            base = member.name.rsplit("/", 1)[-1]
            key = member.name[: len(member.name) - len(base)] + base.split(".", 1)[0]
            groups.setdefault(key, {})[base.split(".", 1)[-1].lower()] = member
    return groups


def tar_raw(name: str, parts: dict[str, bytes]) -> Raw:
    """One WebDataset sample: its text (``.txt``, else a ``.json``'s ``messages`` or ``text``)
    and its images (image extensions, in name order)."""
    text: str | list[Any] = ""
    if "txt" in parts:
        text = parts["txt"].decode("utf-8")
    elif "json" in parts:
        record = json.loads(parts["json"])
        text = record["messages"] if "messages" in record else record.get("text", "")
        if "messages" in record and not isinstance(text, list):
            raise ValueError(f"sample {name}: 'messages' must be a list of turns, got {text!r:.60}")
    images = [parts[ext] for ext in sorted(parts) if "." + ext.rsplit(".", 1)[-1] in IMAGE_EXTS]
    return name, text, images


def read_tar(path: Path) -> Iterator[Raw]:
    groups = tar_groups(path)
    with tarfile.open(path) as tar:
        for key, members in groups.items():
            parts = {ext: member_bytes(tar, m) for ext, m in members.items()}
            yield tar_raw(f"{path}:{key}", parts)


def member_bytes(tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    """The content of ``member`` (read at its offset in ``tar``)."""
    f = tar.extractfile(member)
    return b"" if f is None else f.read()


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


def _part_text(part: Any, where: str, i: int) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "image":
        return MARKER
    if kind == "text":
        return part.get("text") or ""
    raise ValueError(
        f"{where}: message {i} has a content part {str(part)[:60]!r}; image-text chat reads "
        "parts of type 'text' (with 'text') and 'image'"
    )


def chat_messages(messages: Any, where: str) -> list[Message]:
    """The validated turns, each content a string with :data:`MARKER` where its images go;
    ``ValueError`` naming ``where`` otherwise."""
    if not isinstance(messages, list):
        raise ValueError(f"{where}: 'messages' must be a list of turns, got {str(messages)[:60]}")
    turns = []
    for i, m in enumerate(messages):
        if isinstance(m, dict) and isinstance(m.get("content"), list):
            m = {**m, "content": "".join(_part_text(p, where, i) for p in m["content"])}
        turns.append(m)
    return validate_conversation({"messages": turns}, where)


def chat_tokens(
    tokenizer: ChatTokenizer,
    messages: Sequence[Message],
    template: str | None,
    images: Iterator[list[int]],
) -> tuple[list[int], list[bool]]:
    """Token ids of the rendered conversation with each marker replaced by the next of
    ``images`` (an image's placeholder ids), and per token whether it is trained on."""
    if template is None:
        pieces = _default_pieces(messages)
        ids: list[int] = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    else:
        pieces, ids = _jinja_pieces(tokenizer, messages, template), []
    train = [False] * len(ids)
    for piece, trained in pieces:
        if isinstance(piece, int):  # the default template's end of turn
            ids.append(tokenizer.eos_id)
            train.append(trained)
            continue
        for j, text in enumerate(piece.split(MARKER)):
            if j:
                run = next(images)
                ids += run
                train += [False] * len(run)
            part = _encode_with_specials(tokenizer, text)
            ids += part
            train += [trained] * len(part)
    return ids, train


def markers(messages: Sequence[Message]) -> int:
    """Image markers in the turns."""
    return sum(m["content"].count(MARKER) for m in messages)


Rules = ImageRules | NavitRules
"""How a tower's images become patches: Qwen-VL's (``vlm_images.py``) or MoonViT's
(``vlm_images.py: NavitRules``)."""


def tokenize(
    raw: Raw,
    tokenizer: TextTokenizer,
    rules: Rules,
    ids: ImageTokens,
    template: str | None = None,
) -> tuple[list[int], list[bool] | None, torch.Tensor, list[tuple[int, int, int]]]:
    """(token ids with placeholders, per token whether it trains (None: every token but the
    placeholders; a chat sample: its assistant turns), pixel values, grids);
    :class:`BadImage` for an image to skip, ``ValueError`` when markers and images do not pair
    up or a chat sample is malformed. ``template``: the chat template (None: the default)."""
    name, text, images = raw
    chat = chat_messages(text, f"sample {name}") if isinstance(text, list) else None
    found = markers(chat) if chat is not None else str(text).count(MARKER)
    if found != len(images):
        raise ValueError(
            f"sample {name}: {found} {MARKER} placeholders but {len(images)} images; "
            f"put one {MARKER} in the text where each image goes"
        )
    patches, runs = [], []
    grids: list[tuple[int, int, int]] = []
    for data in images:
        px, grid = rules.encode(data)
        patches.append(px)
        grids.append(grid)
        runs.append(_placeholders(grid, rules, ids))
    pixels = torch.cat(patches) if patches else torch.zeros(0, rules.patch_dim)
    if chat is not None:
        # our tokenizers (tiktoken, Hugging Face) have the chat data's bos_id (chat_data.py)
        tokens, train = chat_tokens(cast(ChatTokenizer, tokenizer), chat, template, iter(runs))
        return tokens, train, pixels, grids
    pieces = str(text).split(MARKER)
    tokens = tokenizer.encode(pieces[0], bos=True, eos=False)
    for piece, run in zip(pieces[1:], runs, strict=True):
        tokens += run + tokenizer.encode(piece, bos=False, eos=False)
    tokens.append(tokenizer.eos_id)
    return tokens, None, pixels, grids


def _placeholders(grid: tuple[int, int, int], rules: Rules, ids: ImageTokens) -> list[int]:
    start = [ids.vision_start_id] if ids.vision_start_id is not None else []
    end = [ids.vision_end_id] if ids.vision_end_id is not None else []
    return start + [ids.image_token_id] * rules.tokens(grid) + end


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
        template: str | None = None,
    ) -> None:
        self.paths, self.tokenizer, self.seq_len = list(paths), tokenizer, seq_len
        self.template = template  # chat samples' template (None: the default)
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
                sample = self.sample(raw)
                if sample is not None:
                    yield sample

    def sample(self, raw: Raw) -> VLMSample | None:
        """The padded row of one raw sample, or None when it is skipped (counted)."""
        try:
            tokens, train, pixels, grids = tokenize(
                raw, self.tokenizer, self.rules, self.ids, self.template
            )
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
        if train is not None:  # a chat sample: its assistant turns only
            trained = torch.zeros(self.seq_len, dtype=torch.bool)
            trained[: len(tokens) - 1] = torch.tensor(train[1 : len(tokens)], dtype=torch.bool)
            labels[~trained] = IGNORE_INDEX
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
