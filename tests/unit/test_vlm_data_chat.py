"""Chat-format image-text samples (``data/vlm_dataset.py``; docs/vlm.md, "Data"): a ``messages``
column of parquet (content parts, the Hugging Face layout) and a tar shard's ``.json``
(``<image>`` in string content) give the same row; with its placeholders taken out the row is
exactly the chat SFT data's tokens and assistant-only labels (``data/chat_template.py``); the
placeholders never train; malformed conversations are one-line errors naming the sample."""

from __future__ import annotations

import io
import json
import sys
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from torchtitan.data.chat_template import tokenize_conversation
from torchtitan.data.tokenizer import build_tokenizer
from torchtitan.data.vlm_dataset import ImageTokens, VLMDataset, read_source
from torchtitan.data.vlm_images import ImageRules
from torchtitan.loss.chunked import IGNORE_INDEX

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import make_vlm_data  # noqa: E402

TOKENIZER = ROOT / "tests/assets/tokenizer"
IMAGE_ID = 2047
RULES = ImageRules(min_pixels=32 * 32, max_pixels=64 * 64 * 2, max_source_pixels=300 * 300)
SEQ = 128


def _png(seed: int) -> bytes:
    import random

    return make_vlm_data.png(random.Random(seed))[0]


def _parts(*items: str) -> list[dict]:
    return [{"type": "image", "text": None} if x == "<image>" else {"type": "text", "text": x}
            for x in items]  # fmt: skip


# Two images in two user turns; the assistant answers twice.
PARTS = [
    {"role": "system", "content": _parts("You describe pictures.")},
    {"role": "user", "content": _parts("<image>", "What colour is it?")},
    {"role": "assistant", "content": _parts("It is red.")},
    {"role": "user", "content": _parts("And this one? ", "<image>")},
    {"role": "assistant", "content": _parts("Blue, mostly.")},
]
STRINGS = [
    {"role": m["role"], "content": "".join(p["text"] or "<image>" for p in m["content"])}
    for m in PARTS
]


def _write(folder: Path) -> tuple[Path, Path]:
    images = [_png(1), _png(2)]
    parquet = folder / "chat.parquet"
    pq.write_table(pa.table({"messages": [PARTS], "images": [images]}), parquet)
    tar = folder / "chat.tar"
    members = {"s0.json": json.dumps({"messages": STRINGS}).encode()}
    members |= {"s0.0.png": images[0], "s0.1.png": images[1]}
    with tarfile.open(tar, "w") as f:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            f.addfile(info, io.BytesIO(data))
    return parquet, tar


def _rows(path: Path) -> list:
    data = VLMDataset([path], build_tokenizer(str(TOKENIZER)), SEQ, RULES, ImageTokens(IMAGE_ID))
    return list(data)


def test_chat_rows_are_the_sft_rows_plus_placeholders(tmp_path: Path) -> None:
    parquet, tar = _write(tmp_path)
    (a,), (b,) = _rows(parquet), _rows(tar)
    assert torch.equal(a.inputs, b.inputs) and torch.equal(a.labels, b.labels)
    assert torch.equal(a.pixel_values, b.pixel_values) and len(a.grid_thw) == 2
    placeholders = a.inputs == IMAGE_ID
    assert int(placeholders.sum()) == int(a.grid_thw.prod(-1).sum()) // 4 > 0
    # the chat SFT tokenization of the same turns without the images
    text_only = [{**m, "content": m["content"].replace("<image>", "")} for m in STRINGS]
    ids, train = tokenize_conversation(build_tokenizer(str(TOKENIZER)), text_only, None)
    n = len(ids)
    assert a.inputs[~placeholders][:n].tolist() == ids
    want = [ids[i + 1] if train[i + 1] else IGNORE_INDEX for i in range(n - 1)]
    assert a.labels[~placeholders][: n - 1].tolist() == want
    assert bool((a.labels[~placeholders][n - 1 :] == IGNORE_INDEX).all())  # padding
    assert not bool((a.labels == IMAGE_ID).any())
    tok = build_tokenizer(str(TOKENIZER))
    trained = a.labels[a.labels != IGNORE_INDEX].tolist()
    answers = tok.encode("It is red.", bos=False, eos=True) + tok.encode(
        "Blue, mostly.", bos=False, eos=True
    )
    assert trained == answers  # the assistant turns and their end-of-turn tokens only


@pytest.mark.parametrize(
    ("messages", "images", "needle"),
    [
        ([{"role": "user", "content": [{"type": "video"}]}], 0, "parts of type 'text'"),
        ([{"role": "user", "content": "<image> hi"}], 1, "no assistant message"),
        ([{"role": "user", "content": "<image> hi"}, {"role": "assistant", "content": "a"}], 2,
         "1 <image> placeholders but 2 images"),
        ("not a list", 0, "'messages' must be a list"),
    ],
    ids=["part-type", "no-assistant", "unpaired", "not-a-list"],
)  # fmt: skip
def test_bad_chat_samples_are_one_line_errors(
    tmp_path: Path, messages: object, images: int, needle: str
) -> None:
    tar = tmp_path / "bad.tar"
    members = {"k7.json": json.dumps({"messages": messages}).encode()}
    members |= {f"k7.{i}.png": _png(i) for i in range(images)}
    with tarfile.open(tar, "w") as f:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            f.addfile(info, io.BytesIO(data))
    data = VLMDataset([], build_tokenizer(str(TOKENIZER)), SEQ, RULES, ImageTokens(IMAGE_ID))
    with pytest.raises(ValueError, match=needle) as e:
        (raw,) = list(read_source(tar))
        data.sample(raw)
    assert "k7" in str(e.value) and "\n" not in str(e.value)
