"""Weighted mixtures: shares by weight, bitwise resume mid-mixture at any dp, the run-out policy
(docs/data.md)."""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.tokenized_helpers import CORPUS, TOKENIZER, make_corpus, split_jsonl
from torchtitan.config.job_config import MixtureSource
from torchtitan.data.builder import DataOptions, build_data_loader
from torchtitan.data.mixture import SourceRunOut
from torchtitan.data.tokenizer import build_tokenizer

SEQ = 16


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> list[MixtureSource]:
    """Two pretokenized corpora (different documents) and one text source."""
    root = tmp_path_factory.mktemp("mixture")
    val = CORPUS / "validation.jsonl"
    lines = val.read_text().splitlines()
    (root / "a_src").mkdir()
    (root / "a_src" / "a.jsonl").write_text("\n".join(lines[:200]) + "\n")
    (root / "b_src").mkdir()
    (root / "b_src" / "b.jsonl").write_text("\n".join(lines[200:400]) + "\n")
    text = split_jsonl(val, root / "text_c", parts=1, lines=None)
    a = make_corpus(root / "corpus_a", "json", str(root / "a_src"))
    b = make_corpus(root / "corpus_b", "json", str(root / "b_src"))
    return [
        MixtureSource(path=str(a), weight=5.0),
        MixtureSource(path=str(b), weight=3.0),
        MixtureSource(path=str(text / "part-0.jsonl"), weight=2.0),
    ]


def _loader(sources: list[MixtureSource], rank: int, dp: int, batch: int, **kw: object):  # noqa: ANN202
    return build_data_loader(
        "mixture", None, build_tokenizer(TOKENIZER), SEQ, batch, rank, dp,
        with_doc_ids=True, options=DataOptions(mixture=sources, **kw),  # type: ignore[arg-type]
    )  # fmt: skip


def _steps(loaders: list, n: int) -> list[list[torch.Tensor]]:  # noqa: ANN001
    its = [iter(ld) for ld in loaders]
    out = []
    for _ in range(n):
        parts = [next(it) for it in its]
        out.append([torch.stack([p[j] for p in parts], 1).flatten(0, 1) for j in range(3)])
    return out


def _equal(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for s, t in zip(a, b) for x, y in zip(s, t))


def test_shares_follow_the_weights(sources: list[MixtureSource]) -> None:
    loader = _loader(sources, 0, 1, 8)
    batches = list(itertools.islice(iter(loader), 250))  # 2,000 windows
    seen = loader.dataset.source_tokens()  # type: ignore[attr-defined]
    windows = {k: v // SEQ for k, v in seen.items()}
    assert sum(windows.values()) == 2000 == sum(b[0].shape[0] for b in batches)
    for src, (name, n) in zip(sources, windows.items()):
        share, weight = n / 2000, src.weight / 10.0
        print(f"{name}: share {share:.4f} weight {weight:.2f}")
        assert abs(share - weight) <= 0.02, (name, share, weight)
    assert loader.dataset.metrics_fields() == {  # type: ignore[attr-defined]
        f"data/tokens_{k}": v for k, v in seen.items()
    }


def test_resume_mid_mixture_is_bitwise_at_any_dp(sources: list[MixtureSource]) -> None:
    """The text source is mid-document and the tokenized ones mid-epoch at the save."""
    ref = _steps([_loader(sources, 0, 1, 8)], 40)
    two = [_loader(sources, r, 2, 4) for r in range(2)]
    assert _equal(_steps(two, 40), ref)  # the global batch at dp 2
    first = [_loader(sources, r, 2, 4) for r in range(2)]
    assert _equal(_steps(first, 17), ref[:17])
    state = {**first[0].state_dict(), **first[1].state_dict()}  # as in a checkpoint
    for dp in (2, 4, 1):
        loaders = [_loader(sources, r, dp, 8 // dp) for r in range(dp)]
        for ld in loaders:
            ld.load_state_dict(state)
        assert _equal(_steps(loaders, 23), ref[17:]), f"resume at dp {dp}"


def test_run_out_policy(sources: list[MixtureSource]) -> None:
    """A small source is exhausted: "error" names it, "wrap" starts its next epoch."""
    small = [sources[0], MixtureSource(path=sources[1].path, weight=50.0)]
    with pytest.raises(SourceRunOut, match="'corpus_b' ran out after"):
        for _ in _loader(small, 0, 1, 64, mixture_exhausted="error"):
            pass
    loader = _loader(small, 0, 1, 64)
    list(itertools.islice(iter(loader), 200))
    assert loader.dataset.source_tokens()["corpus_b"] > 200 * 64 * SEQ * 0.8  # type: ignore[attr-defined]
