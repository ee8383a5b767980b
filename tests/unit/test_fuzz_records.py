"""Fuzzing the records a run trains on (issue #28): chat JSONL conversations (docs/sft.md) and
pretokenized corpora, their shards and manifests (docs/data.md).

Property (docs/errors.md): the preflight (``python -m torchtitan.config``, in process) passes or
fails with one line naming the field and the file; when it passes, the dataset the run builds
(``ChatDataset``; ``TokenCorpus`` + ``WindowOrder`` under every shuffle) gives rows of valid
token ids, or fails with one ``DataError`` naming the file, never a traceback. Nothing the
fuzzer did not write changes. The fast tier runs a small derandomized budget; the ``slow``
tests run >= 100 cases each.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from tests.fuzz_inputs import DEBUG_TOML, ROOT, assert_config_property, snapshot
from tests.tokenized_helpers import TOKENIZER, make_corpus, split_jsonl
from tests.unit.test_fuzz_files import damaged, slow
from torchtitan.config.errors import ConfigError
from torchtitan.data.chat_data import ChatDataset
from torchtitan.data.token_shards import TokenCorpus
from torchtitan.data.tokenized_dataset import WindowOrder
from torchtitan.data.tokenizer import build_tokenizer

CHAT_LINES = (ROOT / "tests/assets/chat/train.jsonl").read_bytes().splitlines()[:4]
SEQ_LEN = 32  # the corpus below holds ~10 windows of it


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tokenizer(TOKENIZER)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("fuzz_records")
    (root / "keep.txt").write_text("untouched\n")
    yield root


def _preflight(work: Path, argv: list[str]) -> int:
    before = snapshot(work)
    rc = assert_config_property(
        ["--job.config_file", DEBUG_TOML, "--job.dump_folder", str(work / "out"), *argv]
    )
    assert snapshot(work) == before
    event(f"preflight exit {rc}")  # --hypothesis-show-statistics: how many reach the data path
    return rc


def _data_error_names(e: ConfigError, path: Path) -> None:
    """The one-line error of the data path names the file (or its folder)."""
    assert str(path) in str(e) and "\n" not in str(e), str(e)


# --------------------------------------------------------------------------- chat records
_TEXT = st.text(max_size=12) | st.sampled_from(["", "\\ud800", "\u0000", "<|assistant|>"])
_ROLES = st.sampled_from(["user", "assistant", "system", "", "tool", "Assistant"])
_MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": _ROLES, "content": _TEXT}),
    st.dictionaries(
        st.sampled_from(["role", "content", "name"]),
        _ROLES | _TEXT | st.integers() | st.none() | st.lists(st.integers(), max_size=2),
        max_size=3,
    ),
    st.integers() | st.none() | _TEXT,
)
_CONVERSATION = st.one_of(
    st.fixed_dictionaries({"messages": st.lists(_MESSAGE, max_size=4)}),
    st.dictionaries(st.sampled_from(["messages", "text", ""]), _TEXT | st.none(), max_size=2),
    st.lists(_MESSAGE, max_size=2) | _TEXT | st.integers() | st.none(),
)


def _json_line(obj: Any) -> bytes:
    # ensure_ascii=False writes the raw text; a lone surrogate then goes in as an escape
    text = json.dumps(obj, ensure_ascii=False)
    return text.encode("utf-8", errors="backslashreplace").replace(b"\\x", b"\\u00")


_GOOD_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system"]), "content": _TEXT}
)
_BAD_LINE = st.one_of(
    st.sampled_from(CHAT_LINES).flatmap(damaged),
    _CONVERSATION.map(_json_line),
    st.sampled_from([b"", b"   ", b"\xff\xfe", b'{"messages": [\xc3]}']),
)


@st.composite
def chat_file(draw: st.DrawFn) -> bytes:
    """JSONL lines: shipped and drawn well-formed conversations, and in half the files one
    damaged line (truncated, bit-flipped, mistyped, not UTF-8) somewhere among them."""
    good = st.sampled_from(CHAT_LINES) | st.fixed_dictionaries(
        {"messages": st.lists(_GOOD_MESSAGE, min_size=1, max_size=4)}
    ).map(_json_line)
    lines = draw(st.lists(good, min_size=1, max_size=4))
    if draw(st.booleans()):
        lines.insert(draw(st.integers(0, len(lines))), draw(_BAD_LINE))
    return b"\n".join(lines)


CHAT_OPTIONS = st.fixed_dictionaries(
    {
        "sft.overlong": st.sampled_from(["truncate", "truncate", "drop", "error"]),
        "sft.packing": st.sampled_from(["pack", "pad"]),
        "training.seq_len": st.sampled_from([8, 64, 512, 512]),
    }
)


def chat_case(work: Path, tokenizer: Any, data: bytes, opts: dict[str, Any]) -> None:
    path = work / "chat" / "train.jsonl"
    shutil.rmtree(path.parent, ignore_errors=True)
    path.parent.mkdir()
    path.write_bytes(data)
    argv = ["--training.dataset", "chat", "--training.dataset_path", str(path)]
    argv += [x for k, v in opts.items() for x in (f"--{k}", str(v))]
    if _preflight(work, argv) != 0:
        return
    # passed the preflight: the dataset builds (the preflight tokenizes as it does)
    ds = ChatDataset(
        path,
        tokenizer,
        opts["training.seq_len"],
        packing=opts["sft.packing"],
        overlong=opts["sft.overlong"],
    )
    inputs, labels = next(iter(ds))
    assert inputs.shape == labels.shape == (opts["training.seq_len"],)
    assert int(inputs.min()) >= 0 and int(inputs.max()) < tokenizer.vocab_size
    assert (labels != -100).any()


@settings(max_examples=30)
@given(data=chat_file(), opts=CHAT_OPTIONS)
def test_fuzz_chat_records(work: Path, tokenizer: Any, data: bytes, opts: dict[str, Any]) -> None:
    chat_case(work, tokenizer, data, opts)


@pytest.mark.slow
@slow(200)
@given(data=chat_file(), opts=CHAT_OPTIONS)
def test_fuzz_chat_records_large(
    work: Path, tokenizer: Any, data: bytes, opts: dict[str, Any]
) -> None:
    chat_case(work, tokenizer, data, opts)


# --------------------------------------------------------------------------- token shards
@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two shards of 12 documents of the shipped test corpus, pretokenized once."""
    tmp = tmp_path_factory.mktemp("fuzz_tokens")
    src = split_jsonl(ROOT / "tests/assets/test_corpus/train.jsonl", tmp / "src", 2, lines=12)
    return make_corpus(tmp / "corpus", dataset="json", dataset_path=str(src))


SHARD_FILES = [
    "manifest.json",
    "shard_00000.bin",
    "shard_00001.bin",
    "shard_00000.idx.npy",
    "shard_00001.idx.npy",
    "shard_00000.done",
]


def _manifest_edits() -> st.SearchStrategy[list[tuple[str, Any]]]:
    """Well-formed JSON, wrong content: (dotted key, new value; None deletes)."""
    keys = st.sampled_from(
        ["format", "dtype", "total_tokens", "shards", "tokenizer", "tokenizer.eos_id"]
        + ["tokenizer.vocab_size", "shards.0.tokens", "shards.0.documents", "shards.1"]
    )
    values = st.one_of(
        st.none(), st.integers(-3, 10**6), st.sampled_from(["uint8", "int64", "float32", "x"]),
        st.lists(st.integers(0, 5), max_size=2), st.text(max_size=4), st.just({}),
    )  # fmt: skip
    return st.lists(st.tuples(keys, values), min_size=1, max_size=3)


def _edit(manifest: Any, key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    node = manifest
    for p in parents:  # an earlier edit may have made a parent a list or a scalar: skip then
        if isinstance(node, list):
            node = node[int(p)] if p.isdigit() and int(p) < len(node) else None
        else:
            node = node.get(p)
        if not isinstance(node, (dict, list)):
            return
    if isinstance(node, list):
        if leaf.isdigit() and int(leaf) < len(node):
            node[int(leaf)] = value
    elif value is None:
        node.pop(leaf, None)
    else:
        node[leaf] = value


@st.composite
def shard_damage(draw: st.DrawFn, corpus: Path) -> tuple[str, bytes | None]:
    """(file, new bytes or None to delete it): bit flips, truncations, splices, random bytes,
    edited manifests."""
    name = draw(st.sampled_from(SHARD_FILES))
    if draw(st.integers(0, 9)) == 0:
        return name, None
    original = (corpus / name).read_bytes()
    if name == "manifest.json" and draw(st.booleans()):
        manifest = json.loads(original)
        for key, value in draw(_manifest_edits()):
            _edit(manifest, key, value)
        return name, json.dumps(manifest).encode()
    return name, draw(damaged(original))


def _read_everything(folder: Path, tokenizer: Any) -> None:
    corpus = TokenCorpus(folder, tokenizer)
    for shuffle in ("none", "windows", "documents"):
        order = WindowOrder(corpus, SEQ_LEN + 1, shuffle, seed=3)  # type: ignore[arg-type]
        for i in range(order.per_epoch + 1):
            tokens, doc_ids = order.read(i)
            assert tokens.shape == doc_ids.shape == (SEQ_LEN + 1,)
            assert int(tokens.min()) >= 0 and int(tokens.max()) < tokenizer.vocab_size
            assert np.all(np.diff(doc_ids) >= 0)


def shard_case(work: Path, corpus: Path, tokenizer: Any, name: str, data: bytes | None) -> None:
    folder = work / "tokens"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(corpus, folder)
    if data is None:
        (folder / name).unlink()
    else:
        (folder / name).write_bytes(data)
    argv = ["--training.dataset", "tokenized", "--training.dataset_path", str(folder)]
    if _preflight(work, argv + ["--training.seq_len", str(SEQ_LEN)]) != 0:
        return
    try:
        _read_everything(folder, tokenizer)
    except ConfigError as e:  # damage only the data path can see (a flipped token)
        event(f"data path: {type(e).__name__}")
        _data_error_names(e, folder)


@settings(max_examples=30)
@given(data=st.data())
def test_fuzz_token_shards(work: Path, corpus: Path, tokenizer: Any, data: st.DataObject) -> None:
    shard_case(work, corpus, tokenizer, *data.draw(shard_damage(corpus)))


@pytest.mark.slow
@slow(200)
@given(data=st.data())
def test_fuzz_token_shards_large(
    work: Path, corpus: Path, tokenizer: Any, data: st.DataObject
) -> None:
    shard_case(work, corpus, tokenizer, *data.draw(shard_damage(corpus)))


def test_intact_corpus_reads(corpus: Path, tokenizer: Any) -> None:
    """The undamaged corpus passes the same checks: 2 shards, every window read."""
    manifest = json.loads((corpus / "manifest.json").read_text())
    assert len(manifest["shards"]) == 2 and manifest["total_tokens"] > 4 * (SEQ_LEN + 1)
    _read_everything(corpus, tokenizer)
