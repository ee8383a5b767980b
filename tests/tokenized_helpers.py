"""Pre-tokenized corpora for the tests, made from the shipped test corpus (docs/data.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from torchtitan.data.pretokenize import PretokenizeJob, pretokenize

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "assets" / "test_corpus"
TOKENIZER = str(ROOT / "tests" / "assets" / "tokenizer")

_CACHE: dict[str, Path] = {}


def make_corpus(
    out: Path,
    dataset: str = "test_corpus",
    dataset_path: str | None = None,
    split: str = "train",
    workers: int = 1,
) -> Path:
    job = PretokenizeJob(dataset, dataset_path, split, TOKENIZER, str(out), workers)
    pretokenize(job, show_progress=False)
    return out


def split_jsonl(src: Path, out_dir: Path, parts: int, lines: int | None = None) -> Path:
    """The first ``lines`` documents of ``src`` as ``parts`` files ``part-<k>.jsonl``."""
    docs = src.read_text().splitlines()[:lines]
    out_dir.mkdir(parents=True, exist_ok=True)
    per = -(-len(docs) // parts)
    for k in range(parts):
        (out_dir / f"part-{k}.jsonl").write_text(
            "".join(d + "\n" for d in docs[k * per : (k + 1) * per])
        )
    return out_dir


def cached_corpus(tmp_path_factory: pytest.TempPathFactory, split: str) -> Path:
    """The test corpus's ``split`` pretokenized once per pytest session."""
    if split not in _CACHE:
        _CACHE[split] = make_corpus(tmp_path_factory.mktemp(f"tokens_{split}"), split=split)
    return _CACHE[split]
