"""Dataset/dataloader: packing, data-parallel sharding, epochs, exact resume, errors."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from torchtitan.data.dataloader import (  # noqa: E402
    PackedTokenDataset,
    ParallelAwareDataloader,
    build_dataloader,
)
from torchtitan.data.sources import load_text_dataset  # noqa: E402
from torchtitan.data.tokenizer import Tokenizer, build_tokenizer  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return build_tokenizer("tests/assets/tokenizer")


def doc_text(i: int) -> str:
    return f"document {i} begins. " + " ".join(f"w{i}x{j}" for j in range(i % 5 + 3)) + " end."


def write_docs(path: Path, ids: list[int]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for i in ids:
            f.write(json.dumps({"text": doc_text(i), "id": i}) + "\n")


@pytest.fixture
def one_file(tmp_path: Path) -> Path:
    write_docs(tmp_path / "data" / "train.jsonl", list(range(40)))
    return tmp_path / "data"


@pytest.fixture
def four_files(tmp_path: Path) -> Path:
    for k in range(4):
        write_docs(tmp_path / "multi" / f"train-{k:05d}.jsonl", list(range(10 * k, 10 * k + 10)))
    write_docs(tmp_path / "multi" / "validation.jsonl", [100, 101])
    return tmp_path / "multi"


def make(path: Path, tok: Tokenizer, **kw) -> ParallelAwareDataloader:
    args = dict(dataset="local", dataset_path=str(path), tokenizer=tok, seq_len=16)
    args.update(local_batch_size=2, dp_rank=0, dp_world_size=1)
    args.update(kw)
    return build_dataloader(**args)  # type: ignore[arg-type]


def windows(loader) -> list[torch.Tensor]:
    """All (inputs, labels) rows of a finite loader as seq_len+1 token windows."""
    out = []
    for inputs, labels in loader:
        for x, y in zip(inputs, labels):
            out.append(torch.cat([x, y[-1:]]))
    return out


def doc_ids(tok: Tokenizer, wins: list[torch.Tensor]) -> list[int]:
    text = tok.decode(torch.cat(wins)) if wins else ""
    return [int(m) for m in re.findall(r"document (\d+) begins", text)]


def test_packing(one_file: Path, tok: Tokenizer) -> None:
    seq = 16
    loader = make(one_file, tok, seq_len=seq, local_batch_size=3, infinite=False)
    batches = list(loader)
    for inputs, labels in batches[:-1]:
        assert inputs.shape == labels.shape == (3, seq)
        assert inputs.dtype == labels.dtype == torch.int64
        assert torch.equal(inputs[:, 1:], labels[:, :-1])  # labels are inputs shifted by one
    stream = [t for i in range(40) for t in tok.encode(doc_text(i), bos=True, eos=True)]
    packed = torch.cat(windows(batches))
    n_windows = len(stream) // (seq + 1)
    assert packed.tolist() == stream[: n_windows * (seq + 1)]  # documents in order, BOS..EOS
    assert packed.tolist().count(tok.eos_id) >= 39


@pytest.mark.parametrize("layout", ["one_file", "four_files"])
def test_dp_sharding_disjoint_and_complete(layout: str, tok: Tokenizer, request) -> None:
    path = request.getfixturevalue(layout)
    seen = []
    for rank in range(4):
        loader = make(
            path, tok, seq_len=8, dp_rank=rank, dp_world_size=4, infinite=False, sharding="document"
        )
        wins = windows(loader)
        seen.append(set(doc_ids(tok, wins)))
        assert seen[-1], f"rank {rank} got no documents"
    for a in range(4):
        for b in range(a + 1, 4):
            assert not seen[a] & seen[b], f"ranks {a} and {b} share documents"
    assert set().union(*seen) == set(range(40))


@pytest.mark.parametrize("dp", [2, 4])
def test_window_sharding_gives_every_dp_degree_the_same_data(
    one_file: Path, tok: Tokenizer, dp: int
) -> None:
    single = windows(make(one_file, tok, seq_len=8, infinite=False))
    per_rank = [
        windows(make(one_file, tok, seq_len=8, dp_rank=r, dp_world_size=dp, infinite=False))
        for r in range(dp)
    ]
    rounds = len(single) // dp
    assert rounds > 10
    for r in range(dp):
        assert len(per_rank[r]) >= rounds
        for j in range(rounds):
            assert torch.equal(per_rank[r][j], single[j * dp + r]), f"dp={dp} rank {r} window {j}"


def test_window_sharding_resumes_at_another_dp_degree(one_file: Path, tok: Tokenizer) -> None:
    # Global batch 4 windows: dp 2 x local 2 for 3 steps, then dp 4 x local 1.
    single = windows(make(one_file, tok, seq_len=8, infinite=False))
    old = [
        make(one_file, tok, seq_len=8, dp_rank=r, dp_world_size=2, local_batch_size=2)
        for r in range(2)
    ]
    its = [iter(x) for x in old]
    for _ in range(3):
        for it in its:
            next(it)
    state = old[1].state_dict()
    assert state["dp_world_size"] == 2
    for r in range(4):
        new = make(one_file, tok, seq_len=8, dp_rank=r, dp_world_size=4, local_batch_size=1)
        new.load_state_dict(state)
        x, y = next(iter(new))
        assert torch.equal(torch.cat([x[0], y[0, -1:]]), single[12 + r]), f"new rank {r}"


def test_infinite_loops_over_epochs(tmp_path: Path, tok: Tokenizer) -> None:
    write_docs(tmp_path / "train.jsonl", [0, 1, 2])
    epoch = [t for i in range(3) for t in tok.encode(doc_text(i), bos=True, eos=True)]
    seq = 7
    n = 3 * len(epoch) // (seq + 1)  # about three epochs of windows
    it = iter(make(tmp_path, tok, seq_len=seq, local_batch_size=1))
    got = torch.cat([torch.cat([x[0], y[0, -1:]]) for x, y in (next(it) for _ in range(n))])
    assert got.tolist() == (epoch * 4)[: n * (seq + 1)]
    finite = make(tmp_path, tok, seq_len=seq, local_batch_size=1, infinite=False)
    assert len(list(finite)) == len(epoch) // (seq + 1)


@pytest.mark.parametrize("num_workers", [0, 1, 2])
@pytest.mark.parametrize("k", [0, 3, 7])
def test_resume_is_exact(four_files: Path, tok: Tokenizer, num_workers: int, k: int) -> None:
    # 2 dp ranks x 2 files each (740 tokens per epoch on rank 1); batches of 2 x 65 tokens:
    # resuming at 7 resumes in the second epoch, and the batches compared cross epochs.
    kw = dict(seq_len=64, local_batch_size=2, dp_rank=1, dp_world_size=2, num_workers=num_workers)
    ref_it = iter(make(four_files, tok, **kw))
    reference = [next(ref_it) for _ in range(k + 6)]

    first = make(four_files, tok, **kw)
    it = iter(first)
    for _ in range(k):
        next(it)
    state = first.state_dict()
    assert set(state) == {"dp_rank_1", "dp_world_size"} and state["dp_world_size"] == 2

    resumed = make(four_files, tok, **kw)
    resumed.load_state_dict(state)
    it2 = iter(resumed)
    for i, (x, y) in enumerate(next(it2) for _ in range(6)):
        assert torch.equal(x, reference[k + i][0]) and torch.equal(y, reference[k + i][1]), (
            f"batch {k + i} differs after resuming at {k} (num_workers={num_workers})"
        )
    if num_workers == 0:
        assert resumed.dataset.state_dict()["epoch"] >= 1  # type: ignore[attr-defined]


def test_state_of_unstarted_resumed_loader_round_trips(four_files: Path, tok: Tokenizer) -> None:
    loader = make(four_files, tok)
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    again = make(four_files, tok)
    again.load_state_dict(state)
    third = make(four_files, tok)
    third.load_state_dict(again.state_dict())  # saved before iterating: same position
    assert torch.equal(next(iter(third))[0], next(it)[0])


def test_dataset_state_carries_buffer_and_epoch(tmp_path: Path, tok: Tokenizer) -> None:
    write_docs(tmp_path / "train.jsonl", [0, 1])
    hf, column = load_text_dataset("local", str(tmp_path))
    ds = PackedTokenDataset(hf, tok, seq_len=4, text_column=column)
    it = iter(ds)
    for _ in range(20):  # 62 tokens per epoch: 12 windows of 5
        next(it)
    state = ds.state_dict()
    assert set(state) == {"hf", "buffer", "epoch", "windows"} and state["epoch"] >= 1
    assert len(state["buffer"]) < 5 + 33  # leftover < one window + one document


def test_dp_world_size_mismatch_raises(four_files: Path, tok: Tokenizer) -> None:
    loader = make(four_files, tok, dp_rank=0, dp_world_size=2, sharding="document")
    next(iter(loader))
    state = loader.state_dict()
    with pytest.raises(ValueError, match="data-parallel world size of 2, this run has 4"):
        make(four_files, tok, dp_rank=0, dp_world_size=4, sharding="document").load_state_dict(
            state
        )


def test_missing_rank_key_warns_and_starts_fresh(four_files: Path, tok: Tokenizer) -> None:
    loader = make(four_files, tok, dp_rank=0, dp_world_size=2)
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    other = make(four_files, tok, dp_rank=1, dp_world_size=2)
    with pytest.warns(UserWarning, match="no state for dp_rank_1"):
        other.load_state_dict(state)
    fresh = make(four_files, tok, dp_rank=1, dp_world_size=2)
    assert torch.equal(next(iter(other))[0], next(iter(fresh))[0])


def test_test_corpus_from_any_cwd(tmp_path: Path, tok: Tokenizer, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    for split in ("train", "validation"):
        loader = build_dataloader(
            "test_corpus", None, tok, seq_len=32, local_batch_size=2, dp_rank=0, dp_world_size=1,
            split=split, infinite=False,
        )  # fmt: skip
        inputs, labels = next(iter(loader))
        assert inputs.shape == (2, 32) and inputs[0, 0].item() == tok.bos_id


def test_split_selection_in_directory(four_files: Path, tok: Tokenizer) -> None:
    wins = windows(make(four_files, tok, seq_len=4, split="validation", infinite=False))
    assert set(doc_ids(tok, wins)) <= {100, 101} and doc_ids(tok, wins)
    with pytest.raises(ValueError, match="no data files for split 'test'"):
        make(four_files, tok, split="test")


def test_txt_files(tmp_path: Path, tok: Tokenizer) -> None:
    (tmp_path / "a.txt").write_text(doc_text(1) + "\n\n" + doc_text(2) + "\n")
    wins = windows(make(tmp_path, tok, seq_len=4, infinite=False))
    assert doc_ids(tok, wins) == [1, 2]  # one document per paragraph


def test_bad_paths_raise(tmp_path: Path, tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match=r"training\.dataset_path = 'nope/missing'"):
        make(Path("nope/missing"), tok)
    with pytest.raises(ValueError, match=r"training\.dataset = '\./nope\.jsonl'"):
        load_text_dataset("./nope.jsonl", None)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no data files"):
        make(tmp_path / "empty", tok)


def test_hub_name_offline_fails_clearly(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match=r"training\.dataset = 'no-such-user/no-such-dataset'"):
        load_text_dataset("no-such-user/no-such-dataset", None)


def test_multiworker_order_is_deterministic_across_epochs(four_files: Path, tok: Tokenizer) -> None:
    # Regression: the HF dataset's epoch is shared between DataLoader workers; workers must not
    # race on it (rank 1 has ~6 batches per epoch here, so 14 batches cross two epochs).
    kw = dict(seq_len=64, local_batch_size=2, dp_rank=1, dp_world_size=2, num_workers=2)
    runs = []
    for _ in range(3):
        it = iter(make(four_files, tok, **kw))
        runs.append(torch.cat([next(it)[0] for _ in range(14)]))
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])


def test_finite_loader_restarts_on_each_iter(one_file: Path, tok: Tokenizer) -> None:
    # A validation loader is iterated once per evaluation and must give the same batches.
    loader = make(one_file, tok, seq_len=16, infinite=False)
    first, second = windows(loader), windows(loader)
    assert first and all(torch.equal(a, b) for a, b in zip(first, second))
    assert len(first) == len(second)


def test_doc_ids_ride_with_the_batch_and_resume_exactly(four_files: Path, tok: Tokenizer) -> None:
    """block_causal batches are (inputs, labels, doc_ids): int32 [B, S], +1 after every EOS of
    the inputs; the tokens equal the causal loader's, and a resumed loader continues exactly."""
    kw = dict(seq_len=64, local_batch_size=2, dp_rank=1, dp_world_size=2)
    plain = [next(it) for it in [iter(make(four_files, tok, **kw))] for _ in range(5)]
    ref_it = iter(make(four_files, tok, with_doc_ids=True, **kw))
    reference = [next(ref_it) for _ in range(5)]
    for (x, y), (x2, y2, ids) in zip(plain, reference):
        assert torch.equal(x, x2) and torch.equal(y, y2)
        assert ids.dtype == torch.int32 and ids.shape == x.shape
        eos_before = (x == tok.eos_id).int().cumsum(1) - (x == tok.eos_id).int()
        assert torch.equal(ids, eos_before)
    assert max(int(ids.max()) for *_, ids in reference) >= 2  # several documents per window
    first = make(four_files, tok, with_doc_ids=True, **kw)
    it = iter(first)
    next(it), next(it)
    resumed = make(four_files, tok, with_doc_ids=True, **kw)
    resumed.load_state_dict(first.state_dict())
    it2 = iter(resumed)
    for want in reference[2:]:
        got = next(it2)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
