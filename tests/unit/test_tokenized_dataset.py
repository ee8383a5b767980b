"""The tokenized dataset: windows by arithmetic, the text path's windows and document ids, the same
global batch and resume position at any data-parallel degree, seeded shuffles (docs/data.md)."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.tokenized_helpers import TOKENIZER, cached_corpus
from torchtitan.data.builder import build_data_loader
from torchtitan.data.dataloader import build_dataloader
from torchtitan.data.token_shards import TokenCorpus
from torchtitan.data.tokenized_dataset import (
    TokenizedDataset,
    WindowOrder,
    feistel_permute,
)
from torchtitan.data.tokenizer import build_tokenizer

SEQ = 64


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return cached_corpus(tmp_path_factory, "validation")


@pytest.fixture(scope="module")
def corpus(folder: Path) -> TokenCorpus:
    return TokenCorpus(folder, build_tokenizer(TOKENIZER))


def _loader(folder: Path, dp_rank: int, dp: int, batch: int, **kw: object):  # noqa: ANN202
    from torchtitan.data.builder import DataOptions

    return build_data_loader(
        "tokenized",
        str(folder),
        build_tokenizer(TOKENIZER),
        SEQ,
        batch,
        dp_rank,
        dp,
        with_doc_ids=True,
        options=DataOptions(**kw),  # type: ignore[arg-type]
    )


def _global_batches(folder: Path, dp: int, steps: int, global_batch: int = 8, state=None, **kw):  # noqa: ANN001, ANN003, ANN202
    """Per step, the global batch (dp rank order, as the text path's window sharding)."""
    loaders = [_loader(folder, r, dp, global_batch // dp, **kw) for r in range(dp)]
    if state is not None:
        for ld in loaders:
            ld.load_state_dict(state)
    its = [iter(ld) for ld in loaders]
    out = []
    for _ in range(steps):
        parts = [next(it) for it in its]
        # rank r holds windows p + r, p + dp + r, ...: interleave back into global order
        out.append([torch.stack([p[j] for p in parts], 1).flatten(0, 1) for j in range(3)])
    return out, loaders


def test_same_windows_and_doc_ids_as_the_text_path(folder: Path, corpus: TokenCorpus) -> None:
    """Also across the epoch boundary, where the text path carries its token buffer over."""
    per_epoch = corpus.num_tokens // (SEQ + 1)
    text = build_dataloader(
        "test_corpus", None, build_tokenizer(TOKENIZER), SEQ, 16, 0, 1,
        split="validation", with_doc_ids=True,
    )  # fmt: skip
    ours = _loader(folder, 0, 1, 16)
    n = per_epoch // 16 + 3
    for step, (a, b) in enumerate(itertools.islice(zip(text, ours), n)):
        for x, y in zip(a, b):
            assert torch.equal(x, y), f"batch {step} differs"
    assert n * 16 > per_epoch + 20


def test_global_batch_and_resume_at_any_dp(folder: Path) -> None:
    ref, _ = _global_batches(folder, 1, 6)
    for dp in (2, 4):
        got, _ = _global_batches(folder, dp, 6)
        assert all(torch.equal(x, y) for a, b in zip(ref, got) for x, y in zip(a, b)), dp
    # Save at dp 2 after 3 steps, resume at dp 4 and at dp 1: the data position is kept.
    _, loaders = _global_batches(folder, 2, 3)
    state = loaders[1].state_dict()
    # the whole data state is the global position: steps x global batch, the same on every rank
    assert [ld.dataset.state_dict() for ld in loaders] == [{"windows": 3 * 8}] * 2
    for dp in (4, 1):
        resumed, _ = _global_batches(folder, dp, 3, state=state)
        assert all(torch.equal(x, y) for a, b in zip(ref[3:], resumed) for x, y in zip(a, b)), dp


def test_rank_1023_reads_only_its_windows(corpus: TokenCorpus) -> None:
    ds = TokenizedDataset(corpus, SEQ, dp_rank=1023, dp_world_size=1024)
    ds.load_state_dict({"windows": 5 * 1024})
    first = next(iter(ds))
    tokens = torch.from_numpy(corpus.read((5 * 1024 + 1023) * (SEQ + 1), SEQ + 1)[0])
    assert torch.equal(first[0], tokens[:-1]) and torch.equal(first[1], tokens[1:])
    assert ds.state_dict() == {"windows": 6 * 1024}


@pytest.mark.parametrize("n", [1, 2, 5, 17, 1000, 4097])
def test_feistel_is_a_permutation(n: int) -> None:
    perm = [feistel_permute(j, n, key=12345) for j in range(n)]
    assert sorted(perm) == list(range(n))
    if n >= 1000:
        assert perm != list(range(n)) and perm != [feistel_permute(j, n, 99) for j in range(n)]


def test_window_shuffle_visits_every_window_each_epoch(corpus: TokenCorpus) -> None:
    order = WindowOrder(corpus, SEQ + 1, "windows", seed=3)
    plain = WindowOrder(corpus, SEQ + 1)
    n = order.per_epoch
    key = {plain.read(i)[0].tobytes(): i for i in range(n)}
    for epoch in (0, 1):
        seen = [key[order.read(epoch * n + j)[0].tobytes()] for j in range(n)]
        assert sorted(seen) == list(range(n)) and seen != list(range(n))
    assert [key[order.read(j)[0].tobytes()] for j in range(5)] != [
        key[order.read(n + j)[0].tobytes()] for j in range(5)
    ]


def test_document_shuffle_keeps_documents_whole(corpus: TokenCorpus) -> None:
    order = WindowOrder(corpus, SEQ + 1, "documents", seed=7)
    n = order.per_epoch
    tokens, ids = zip(*(order.read(i) for i in range(n)))
    stream = np.concatenate(tokens)
    bounds = corpus.doc_bounds()
    perm, _, _ = order._documents(0)
    docs = [corpus.read(int(bounds[d]), int(bounds[d + 1] - bounds[d]))[0] for d in perm]
    assert np.array_equal(stream, np.concatenate(docs)[: len(stream)])
    assert not np.array_equal(stream, corpus.read(0, len(stream))[0])
    # doc ids restart at 0 in each window and step up exactly where a document starts
    bos = build_tokenizer(TOKENIZER).bos_id
    for t, d in zip(tokens[:50], ids[:50]):
        assert d[0] == 0 and np.array_equal(np.diff(d) == 1, t[1:] == bos)


def test_one_pass_for_validation(corpus: TokenCorpus) -> None:
    """infinite=False (validation) gives the whole rounds of one pass, the same on every rank."""
    per_epoch = corpus.num_tokens // (SEQ + 1)
    counts = [sum(1 for _ in TokenizedDataset(corpus, SEQ, r, 3, infinite=False)) for r in range(3)]
    assert counts == [per_epoch // 3] * 3
    ds = TokenizedDataset(corpus, SEQ, infinite=False)
    assert sum(1 for _ in ds) == per_epoch and ds.state_dict() == {"windows": per_epoch}


def test_validation_loader_matches_the_text_path(folder: Path) -> None:
    """validation.dataset = "tokenized": the same batches as the text validation loader, at
    rank 1 of 2, to the end of the one pass."""
    tok = build_tokenizer(TOKENIZER)
    text = build_dataloader(
        "test_corpus", None, tok, SEQ, 4, 1, 2, split="validation", infinite=False
    )
    ours = build_data_loader(
        "tokenized", str(folder), tok, SEQ, 4, 1, 2, split="validation", infinite=False
    )
    a, b = list(text), list(ours)
    assert len(a) == len(b) > 100
    assert all(torch.equal(x, y) for s, t in zip(a, b) for x, y in zip(s, t))


def test_uint32_corpus(folder: Path, tmp_path: Path) -> None:
    """A corpus stored as uint32 (vocabularies over 65,536) reads the same tokens."""
    import json
    import shutil

    wide = tmp_path / "wide"
    shutil.copytree(folder, wide)
    bin_path = wide / "shard_00000.bin"
    np.fromfile(bin_path, np.uint16).astype(np.uint32).tofile(bin_path)
    manifest = json.loads((wide / "manifest.json").read_text())
    manifest["dtype"] = "uint32"
    (wide / "manifest.json").write_text(json.dumps(manifest))
    narrow, wide_c = TokenCorpus(folder), TokenCorpus(wide)
    n = narrow.num_tokens
    assert wide_c.dtype == np.uint32 and wide_c.num_tokens == n
    for x, y in zip(narrow.read(n - 100, 300), wide_c.read(n - 100, 300)):
        assert np.array_equal(x, y)
