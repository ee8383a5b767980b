"""Data loading: text path vs pretokenized shards, start-up with a large corpus, a far rank.

    python benchmarks/dataloader.py [--corpus-gib 2.0] [--tmp /tmp] [--seq-len 2048]

Prints one JSON line per measurement (docs/data.md, "Benchmark"):

- ``throughput``: tokens/s of one data-parallel rank, reading batches of ``--batch`` windows of
  ``--seq-len`` tokens from the shipped test corpus, for the text path (tokenizing on the fly,
  ``data_sharding = "window"``) and for its pretokenized shards, at dp 1 and at rank 0 of dp 8
  (the text path tokenizes all 8 ranks' windows to keep one).
- ``startup``: on a synthetic corpus of ``--corpus-gib`` GiB of uint16 tokens written into
  ``--tmp`` (never the repository; deleted at the end unless ``--keep``), and on the small test
  corpus: seconds to open the corpus and build the loader, and to its first batch, at rank 0 of
  1 and at rank 1023 of 1024 (resumed 1,000 rounds in), for ``shuffle`` none/windows/documents; the
  median (and max) of ``--repeat`` fresh loaders.
  The figures must not grow with the corpus, except ``documents``, which reads the document
  index (8 bytes a document) once per epoch.
- ``text_far_rank``: the text path's time to the first batch at rank 1023 of 1024 (it tokenizes
  the 1,023 windows of the other ranks first).

The synthetic corpus is in the page cache right after it is written: the first-batch times are
warm-cache times (a cold read adds one disk read of 2 x seq_len bytes per window).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from torchtitan.data.builder import DataOptions, build_data_loader  # noqa: E402
from torchtitan.data.pretokenize import PretokenizeJob, pretokenize  # noqa: E402
from torchtitan.data.token_shards import (  # noqa: E402
    FORMAT,
    MANIFEST,
    shard_files,
    tokenizer_identity,
)
from torchtitan.data.tokenizer import AnyTokenizer, build_tokenizer  # noqa: E402

TOKENIZER = str(ROOT / "tests" / "assets" / "tokenizer")


def write_synthetic_corpus(out: Path, tokenizer: AnyTokenizer, gib: float, shards: int = 8) -> dict:
    """``gib`` GiB of random uint16 tokens in documents of 64..4095 tokens (BOS ... EOS)."""
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    per_shard = int(gib * (1 << 30)) // 2 // shards
    entries = []
    for k in range(shards):
        lengths = rng.integers(64, 4096, size=per_shard // 64 + 1)
        starts = np.concatenate([[0], np.cumsum(lengths)])
        starts = starts[starts < per_shard]
        starts = np.append(starts, per_shard)
        if starts[-1] - starts[-2] < 2:
            starts = np.delete(starts, -2)
        bin_path, idx_path, done = shard_files(out, k)
        tokens = np.memmap(bin_path, np.uint16, "w+", shape=(per_shard,))
        step = 1 << 26
        for a in range(0, per_shard, step):
            b = min(per_shard, a + step)
            tokens[a:b] = rng.integers(0, tokenizer.num_base_tokens, b - a, dtype=np.uint16)
        tokens[starts[:-1]] = tokenizer.bos_id
        tokens[starts[1:] - 1] = tokenizer.eos_id
        tokens.flush()
        del tokens
        np.save(idx_path, starts.astype(np.int64))
        entries.append({"tokens": per_shard, "documents": len(starts) - 1})
        done.write_text(json.dumps(entries[-1]))
    manifest = {
        "format": FORMAT,
        "source": {"dataset": "synthetic", "dataset_path": None, "split": "train"},
        "tokenizer": tokenizer_identity(tokenizer),
        "dtype": "uint16",
        "total_tokens": per_shard * shards,
        "total_documents": sum(e["documents"] for e in entries),
        "shards": entries,
    }
    (out / MANIFEST).write_text(json.dumps(manifest))
    return manifest


def _loader(dataset: str, path: str | None, tok: AnyTokenizer, args, rank: int, dp: int, **kw):  # noqa: ANN001, ANN003, ANN202
    return build_data_loader(
        dataset, path, tok, args.seq_len, args.batch, rank, dp, with_doc_ids=True,
        split="train", options=DataOptions(**kw),
    )  # fmt: skip


def throughput(args: argparse.Namespace, tok: AnyTokenizer, tokens_dir: Path) -> list[dict]:
    rows = []
    for dp in (1, 8):
        for kind, dataset, path in (
            ("text", "test_corpus", None),
            ("tokenized", "tokenized", str(tokens_dir)),
        ):
            it = iter(_loader(dataset, path, tok, args, 0, dp))
            next(it)  # first batch: start-up is measured separately
            start = time.perf_counter()
            for _ in range(args.batches):
                next(it)
            secs = time.perf_counter() - start
            rank_tokens = args.batches * args.batch * args.seq_len
            rows.append(
                {
                    "bench": "throughput",
                    "loader": kind,
                    "dp": dp,
                    "rank": 0,
                    "tokens_per_s_per_rank": round(rank_tokens / secs),
                    "batches": args.batches,
                }
            )
    return rows


def startup(args: argparse.Namespace, tok: AnyTokenizer, corpora: dict[str, Path]) -> list[dict]:
    rows = []
    for name, folder in corpora.items():
        for shuffle in ("none", "windows", "documents"):
            for rank, dp, resume in ((0, 1, 0), (1023, 1024, 1000 * 1024)):
                build, first = [], []
                for _ in range(args.repeat):  # a fresh loader each time: nothing cached
                    t0 = time.perf_counter()
                    loader = _loader("tokenized", str(folder), tok, args, rank, dp, shuffle=shuffle)
                    if resume:  # as a run resumed at this global window
                        loader.dataset.load_state_dict({"windows": resume})  # type: ignore[attr-defined]
                    t1 = time.perf_counter()
                    next(iter(loader))
                    build.append(t1 - t0)
                    first.append(time.perf_counter() - t1)
                rows.append(
                    {
                        "bench": "startup",
                        "corpus": name,
                        "corpus_tokens": loader.dataset.order.corpus.num_tokens,  # type: ignore[attr-defined]
                        "shuffle": shuffle,
                        "rank": rank,
                        "dp": dp,
                        "resumed_at_window": resume,
                        "build_s": round(statistics.median(build), 4),
                        "first_batch_s": round(statistics.median(first), 4),
                        "first_batch_s_max": round(max(first), 4),
                    }
                )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--corpus-gib", type=float, default=2.0)
    ap.add_argument("--tmp", default=tempfile.gettempdir())
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=3, help="fresh loaders per start-up figure")
    ap.add_argument("--keep", action="store_true", help="keep the synthetic corpus")
    args = ap.parse_args(argv)
    tok = build_tokenizer(TOKENIZER)
    work = Path(tempfile.mkdtemp(prefix="dataloader_bench_", dir=args.tmp))
    try:
        small = work / "test_corpus_tokens"
        pretokenize(
            PretokenizeJob("test_corpus", None, "train", TOKENIZER, str(small)), show_progress=False
        )
        for row in throughput(args, tok, small):
            print(json.dumps(row), flush=True)
        t0 = time.perf_counter()
        big = work / "synthetic"
        manifest = write_synthetic_corpus(big, tok, args.corpus_gib)
        on_disk = sum(p.stat().st_size for p in big.iterdir())
        print(
            json.dumps(
                {
                    "bench": "synthetic_corpus",
                    "gib_on_disk": round(on_disk / (1 << 30), 3),
                    "tokens": manifest["total_tokens"],
                    "documents": manifest["total_documents"],
                    "write_s": round(time.perf_counter() - t0, 1),
                }
            ),
            flush=True,
        )
        for row in startup(args, tok, {"test_corpus": small, "synthetic": big}):
            print(json.dumps(row), flush=True)
        t0 = time.perf_counter()
        next(iter(_loader("test_corpus", None, tok, args, 1023, 1024)))
        far = {"bench": "text_far_rank", "rank": 1023, "dp": 1024}
        print(json.dumps(far | {"first_batch_s": round(time.perf_counter() - t0, 3)}))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
