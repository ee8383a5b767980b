"""Tokenizer: round trips, special ids, the shipped asset, and scripts/train_tokenizer.py."""

from __future__ import annotations

import base64
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tests.script_loader import load
from torchtitan.data.tokenizer import (
    BOS_TOKEN,
    EOS_TOKEN,
    Tokenizer,
    build_tokenizer,
)

ROOT = Path(__file__).resolve().parents[2]
ASSET = ROOT / "tests/assets/tokenizer/tokenizer.model"
CORPUS = ROOT / "tests/assets/test_corpus"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return build_tokenizer(str(ASSET.parent))


SAMPLES = [
    "",
    "Hello, world!",
    "Ada had a dog called Pip. Seven plus five is twelve.",
    "  leading and trailing spaces   ",
    "tabs\tand\nnew\r\nlines\n\n\n",
    "naïve café, Straße, Ελληνικά, русский, עברית, العربية",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "emoji 🤖🚀 with ZWJ 👩‍👩‍👧 and flags 🇫🇷 and combining e\u0301",
    "numbers 1234567890 3.14159 -42 1e-9",
    f"literal specials {BOS_TOKEN} and {EOS_TOKEN} stay text",
    "code: def f(x):\n    return x ** 2  # comment",
]


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, bos=False, eos=False)
    assert tok.decode(ids) == text
    assert all(0 <= i < tok.vocab_size for i in ids)


def test_round_trip_random_unicode(tok: Tokenizer) -> None:
    rng = random.Random(0)
    # All planes, surrogates excluded (they cannot be UTF-8 encoded).
    points = [c for c in range(0x20000) if not 0xD800 <= c <= 0xDFFF]
    for _ in range(200):
        text = "".join(chr(rng.choice(points)) for _ in range(rng.randrange(1, 40)))
        assert tok.decode(tok.encode(text, bos=False, eos=False)) == text


def test_bos_eos_and_vocab(tok: Tokenizer) -> None:
    n_ranks = sum(1 for line in ASSET.read_text().splitlines() if line)
    assert tok.bos_id == n_ranks and tok.eos_id == n_ranks + 1
    assert tok.vocab_size == n_ranks + len(tok.special_tokens) == 2048
    assert 1900 <= n_ranks <= 2100
    ids = tok.encode("hello")
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.encode("hello", bos=False, eos=False) == ids[1:-1]
    assert tok.encode("hello", bos=True, eos=False) == ids[:-1]
    assert tok.decode(ids) == f"{BOS_TOKEN}hello{EOS_TOKEN}"
    # Special-token strings inside text are plain text, never the special ids.
    forged = tok.encode(f"x{EOS_TOKEN}y", bos=False, eos=False)
    assert tok.eos_id not in forged and tok.bos_id not in forged
    assert tok.encode_batch(["a b", "c"]) == [tok.encode("a b"), tok.encode("c")]


def test_decode_accepts_tensors(tok: Tokenizer) -> None:
    torch = pytest.importorskip("torch")
    ids = tok.encode("tensor input", bos=False, eos=False)
    assert tok.decode(torch.tensor(ids)) == "tensor input"


def test_compresses_corpus(tok: Tokenizer) -> None:
    texts = [
        json.loads(line)["text"] for line in (CORPUS / "validation.jsonl").read_text().splitlines()
    ]
    n_bytes = sum(len(t.encode()) for t in texts)
    n_tokens = sum(len(ids) for ids in tok.encode_batch(texts, bos=False, eos=False))
    assert n_bytes / n_tokens > 3.0  # held-out text; ~4 bytes/token when measured


def test_build_from_file_dir_and_other_cwd(tmp_path: Path, monkeypatch) -> None:
    by_file = build_tokenizer(str(ASSET))
    monkeypatch.chdir(tmp_path)  # relative paths fall back to the repository root
    by_rel_dir = build_tokenizer("tests/assets/tokenizer")
    assert by_file.encode("same ids") == by_rel_dir.encode("same ids")


def test_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no/such/tokenizer.*train_tokenizer\.py"):
        build_tokenizer("no/such/tokenizer")
    with pytest.raises(FileNotFoundError, match=r"without a tokenizer\.model"):
        build_tokenizer(str(tmp_path))
    with pytest.raises(ValueError, match="tokenizer_path is empty"):
        build_tokenizer("")
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"model": {"type": "BPE"}}')
    with pytest.raises(ValueError, match="not a Hugging Face tokenizer.json"):
        build_tokenizer(str(bad))  # .json: read as a Hugging Face tokenizer
    gap = tmp_path / "gap.model"
    gap.write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(255)))
    with pytest.raises(ValueError, match="ranks must be exactly"):
        build_tokenizer(str(gap))


def _write_tiny_corpus(path: Path) -> None:
    rng = random.Random(1)
    animals = ["cat", "dog", "owl", "hen", "goat", "frog"]
    with path.open("w", encoding="utf-8") as f:
        for i in range(300):
            a, b = rng.sample(animals, 2)
            text = f"The {a} and the {b} met {i} times. Ünïcödé {a}s said hello to {b}s."
            f.write(json.dumps({"text": text}) + "\n")


def test_train_tokenizer_cli(tmp_path: Path) -> None:
    corpus = tmp_path / "tiny.jsonl"
    _write_tiny_corpus(corpus)
    out = tmp_path / "tok" / "tokenizer.model"
    cmd = [sys.executable, str(ROOT / "scripts/train_tokenizer.py"), str(corpus)]
    subprocess.run([*cmd, "--vocab-size", "320", "--output", str(out)], check=True, cwd=tmp_path)
    lines = out.read_text().splitlines()
    assert len(lines) == 320
    for b in range(256):  # the single bytes come first, rank = byte value
        token, rank = lines[b].split()
        assert base64.b64decode(token) == bytes([b]) and int(rank) == b
    tok = build_tokenizer(str(out.parent))
    assert tok.vocab_size == 320 + len(tok.special_tokens)
    text = "The owl and the frog met 299 times. Ünïcödé owls said hello to frogs."
    ids = tok.encode(text, bos=False, eos=False)
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode()) / 2  # merges were learned and are used
    # Deterministic: training again gives the same file.
    again = tmp_path / "again.model"
    subprocess.run([*cmd, "--vocab-size", "320", "--output", str(again)], check=True)
    assert again.read_bytes() == out.read_bytes()


def test_retrained_file_at_same_path_is_reloaded(tmp_path: Path) -> None:
    # tiktoken caches files by path; a retrained tokenizer at the same path must not be stale.
    trainer = load("scripts/train_tokenizer.py")
    corpus = tmp_path / "tiny.jsonl"
    _write_tiny_corpus(corpus)
    counts = trainer.count_words(trainer.iter_texts([corpus]))
    path = tmp_path / "tokenizer.model"
    trainer.write_ranks(trainer.train_bpe(counts, 300), path)
    assert build_tokenizer(str(path)).vocab_size == 300 + 8
    trainer.write_ranks(trainer.train_bpe(counts, 310), path)
    assert build_tokenizer(str(path)).vocab_size == 310 + 8


def test_shipped_assets_are_reproducible(tmp_path: Path) -> None:
    """The committed corpus and tokenizer are exactly what the scripts produce."""
    subprocess.run(
        [sys.executable, str(ROOT / "scripts/make_test_dataset.py"), "--out-dir", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    hint = (
        "regenerate: python scripts/make_test_dataset.py && python scripts/train_tokenizer.py "
        "tests/assets/test_corpus/train.jsonl --output tests/assets/tokenizer/tokenizer.model"
    )
    for split in ("train", "validation"):
        fresh = (tmp_path / f"{split}.jsonl").read_bytes()
        assert fresh == (CORPUS / f"{split}.jsonl").read_bytes(), hint
    trainer = load("scripts/train_tokenizer.py")
    counts = trainer.count_words(trainer.iter_texts([CORPUS / "train.jsonl"]))
    trainer.write_ranks(trainer.train_bpe(counts, 2040), tmp_path / "tokenizer.model")
    assert (tmp_path / "tokenizer.model").read_bytes() == ASSET.read_bytes(), hint
