"""scripts/pretokenize.py: the token stream of the text path, resumable, verified (docs/data.md)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.script_loader import load
from tests.tokenized_helpers import CORPUS, TOKENIZER, cached_corpus, make_corpus, split_jsonl
from torchtitan.data.pretokenize import verify_shard
from torchtitan.data.sources import load_text_dataset
from torchtitan.data.token_shards import (
    MANIFEST,
    TokenCorpus,
    check_manifest,
    shard_files,
    token_dtype,
)
from torchtitan.data.tokenizer import build_tokenizer


def _text_stream(dataset: str, dataset_path: str | None, split: str) -> list[int]:
    tok = build_tokenizer(TOKENIZER)
    data, column = load_text_dataset(dataset, dataset_path, split)
    return [t for ex in data for t in tok.encode(ex[column], bos=True, eos=True)]


def test_corpus_is_the_text_paths_token_stream(tmp_path_factory: pytest.TempPathFactory) -> None:
    folder = cached_corpus(tmp_path_factory, "train")
    corpus = TokenCorpus(folder, build_tokenizer(TOKENIZER))
    expected = _text_stream("test_corpus", None, "train")
    assert corpus.num_tokens == len(expected) > 500_000
    tokens, doc_ids = corpus.read(0, corpus.num_tokens)
    assert np.array_equal(tokens, np.asarray(expected))
    manifest = json.loads((folder / MANIFEST).read_text())
    assert manifest["dtype"] == "uint16" and manifest["total_tokens"] == len(expected)
    n_docs = sum(1 for _ in load_text_dataset("test_corpus", None, "train")[0])
    assert manifest["total_documents"] == n_docs == int(doc_ids[-1]) + 1


def test_dtype_by_vocabulary() -> None:
    assert token_dtype(65_536) == np.uint16 and token_dtype(65_537) == np.uint32


def test_shards_follow_files_and_resume_after_a_kill(tmp_path: Path) -> None:
    """One shard per input file, written by 2 worker processes; a killed run (a shard without
    its marker) redoes only that shard and ends with the same corpus."""
    src = split_jsonl(CORPUS / "validation.jsonl", tmp_path / "src", parts=3, lines=150)
    out = make_corpus(tmp_path / "tok", dataset_path=str(src), dataset="json", workers=2)
    manifest = json.loads((out / MANIFEST).read_text())
    assert len(manifest["shards"]) == 3 and [s["documents"] for s in manifest["shards"]] == [
        50,
        50,
        50,
    ]
    whole = TokenCorpus(out).read(0, manifest["total_tokens"])[0]
    assert np.array_equal(whole, _text_stream("json", str(src), "train"))

    # Simulate a kill while shard 1 was written: no marker, a partial temporary file, no manifest.
    bin1, _, done1 = shard_files(out, 1)
    done1.unlink()
    (out / MANIFEST).unlink()
    bin1.with_suffix(".bin.tmp").write_bytes(b"\0" * 10)
    before = {k: shard_files(out, k)[0].stat().st_mtime_ns for k in (0, 2)}
    make_corpus(out, dataset_path=str(src), dataset="json")
    assert {k: shard_files(out, k)[0].stat().st_mtime_ns for k in (0, 2)} == before
    assert json.loads((out / MANIFEST).read_text()) == manifest
    assert np.array_equal(TokenCorpus(out).read(0, manifest["total_tokens"])[0], whole)


def test_verification_catches_damage(tmp_path: Path) -> None:
    src = split_jsonl(CORPUS / "validation.jsonl", tmp_path / "src", parts=1, lines=20)
    out = make_corpus(tmp_path / "tok", dataset_path=str(src), dataset="json")
    tok = build_tokenizer(TOKENIZER)
    bin0 = shard_files(out, 0)[0]
    data = bytearray(bin0.read_bytes())
    data[100] ^= 1
    bin0.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="SHA-256|BOS"):
        verify_shard(out, 0, tok)
    bin0.write_bytes(bytes(data[:-2]))
    with pytest.raises(ValueError, match="manifest says"):
        check_manifest(out, json.loads((out / MANIFEST).read_text()), tok)


def test_script_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:

    script = load("scripts/pretokenize.py", "pretokenize_script")
    src = split_jsonl(CORPUS / "validation.jsonl", tmp_path / "src", parts=1, lines=10)
    rc = script.main(
        ["--dataset", "json", "--dataset-path", str(src), "--tokenizer", TOKENIZER]
        + ["--out", str(tmp_path / "o"), "--no-progress"]
    )
    assert rc == 0 and "10 documents in 1 shard(s) of uint16; verified" in capsys.readouterr().out


def test_another_input_redoes_the_shards(tmp_path: Path) -> None:
    """Markers of another input (same folder, same tokenizer) are not taken as done."""
    a = split_jsonl(CORPUS / "validation.jsonl", tmp_path / "a", parts=1, lines=10)
    b = split_jsonl(CORPUS / "train.jsonl", tmp_path / "b", parts=1, lines=12)
    out = make_corpus(tmp_path / "tok", "json", str(a))
    assert json.loads((out / MANIFEST).read_text())["total_documents"] == 10
    make_corpus(out, "json", str(b))
    assert json.loads((out / MANIFEST).read_text())["total_documents"] == 12
    c = split_jsonl(CORPUS / "train.jsonl", tmp_path / "c", parts=2, lines=12)
    two = make_corpus(tmp_path / "tok2", "json", str(c))  # 2 shards
    with pytest.raises(ValueError, match="shards of another input"):
        make_corpus(two, "json", str(a))  # 1 file: shard 1 would be left over
