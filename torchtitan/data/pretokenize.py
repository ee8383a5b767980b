"""Tokenize a text dataset once, offline, into memory-mapped token shards (docs/data.md).

The input is anything ``training.dataset`` / ``dataset_path`` accepts (a registered name, local
JSONL/parquet/text files, a hub dataset); its streaming files are split among worker processes,
one output shard per input file, so the corpus keeps the text path's document order and token
stream exactly (:mod:`torchtitan.data.token_shards` has the format). A shard is written to
temporary names, renamed, and then marked done: a killed run started again redoes only the
shards without a valid marker. At the end every shard is verified against its marker (size,
SHA-256, document index, BOS/EOS at every boundary, ids below the vocabulary) and the manifest
is written last.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import time
from dataclasses import dataclass
from pathlib import Path
from queue import Empty
from typing import Any

import numpy as np

from torchtitan.data.sources import load_text_dataset
from torchtitan.data.token_shards import (
    FORMAT,
    MANIFEST,
    shard_files,
    token_dtype,
    tokenizer_identity,
)
from torchtitan.data.tokenizer import AnyTokenizer, build_tokenizer

__all__ = ["PretokenizeJob", "pretokenize", "verify_shard"]

_FLUSH_TOKENS = 1 << 20  # tokens buffered before a write (and a progress report)


@dataclass(frozen=True)
class PretokenizeJob:
    dataset: str
    dataset_path: str | None
    split: str
    tokenizer_path: str
    out_dir: str
    workers: int = 1


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def _open_shard(job: PretokenizeJob, index: int, num_shards: int) -> Any:
    """The documents of input file ``index`` (a streaming dataset of one file) and its column."""
    data, column = load_text_dataset(job.dataset, job.dataset_path, job.split)
    if num_shards > 1:
        data = data.shard(num_shards=num_shards, index=index, contiguous=True)
    return data, column


def _write_shard(job: PretokenizeJob, index: int, num_shards: int, queue: Any) -> dict[str, Any]:
    """Tokenize input file ``index`` into shard ``index``; returns its marker."""
    tokenizer = build_tokenizer(job.tokenizer_path)
    dtype = token_dtype(tokenizer.vocab_size)
    data, column = _open_shard(job, index, num_shards)
    bin_path, idx_path, done_path = shard_files(Path(job.out_dir), index)
    tmp_bin = bin_path.with_suffix(".bin.tmp")
    starts, pending, buffered, total = [0], [], 0, 0
    with tmp_bin.open("wb") as f:
        for example in data:
            if column not in example:
                raise ValueError(f"{job.dataset}: no {column!r} column (has {sorted(example)})")
            ids = tokenizer.encode(example[column], bos=True, eos=True)
            pending.append(ids)
            buffered += len(ids)
            total += len(ids)
            starts.append(total)
            if buffered >= _FLUSH_TOKENS:
                np.fromiter((t for d in pending for t in d), dtype, buffered).tofile(f)
                queue.put(buffered)
                pending, buffered = [], 0
        if pending:
            np.fromiter((t for d in pending for t in d), dtype, buffered).tofile(f)
            queue.put(buffered)
    tmp_idx = Path(f"{idx_path}.tmp.npy")
    np.save(tmp_idx, np.asarray(starts, dtype=np.int64))
    os.replace(tmp_bin, bin_path)
    os.replace(tmp_idx, idx_path)
    marker = {
        "tokens": total,
        "documents": len(starts) - 1,
        "sha256": _sha256(bin_path),
        "tokenizer_sha256": tokenizer_identity(tokenizer)["sha256"],
        "source": _source(job, num_shards),
    }
    done_path.write_text(json.dumps(marker))
    return marker


def verify_shard(folder: Path, index: int, tokenizer: AnyTokenizer) -> dict[str, Any]:
    """The shard's marker, after checking the files against it; a ValueError names the fault."""
    bin_path, idx_path, done_path = shard_files(folder, index)
    marker = json.loads(done_path.read_text())
    dtype = token_dtype(tokenizer.vocab_size)
    tokens = np.memmap(bin_path, dtype, "r") if bin_path.stat().st_size else np.zeros(0, dtype)
    starts = np.load(idx_path)

    def bad(why: str) -> ValueError:
        return ValueError(f"{bin_path}: {why}; delete {done_path.name} and run again")

    if len(tokens) != marker["tokens"] or len(starts) != marker["documents"] + 1:
        raise bad("token or document count differs from its marker")
    if starts[0] != 0 or starts[-1] != len(tokens) or np.any(np.diff(starts) < 2):
        raise bad("document index is not increasing from 0 to the token count")
    if len(tokens) and (
        np.any(tokens[starts[:-1]] != tokenizer.bos_id)
        or np.any(tokens[starts[1:] - 1] != tokenizer.eos_id)
        or int(tokens.max()) >= tokenizer.vocab_size
    ):
        raise bad("a document does not run BOS ... EOS, or an id is outside the vocabulary")
    if _sha256(bin_path) != marker["sha256"]:
        raise bad("SHA-256 differs from its marker")
    return marker


def _source(job: PretokenizeJob, num_shards: int) -> dict[str, Any]:
    return {
        "dataset": job.dataset,
        "dataset_path": job.dataset_path,
        "split": job.split,
        "num_shards": num_shards,
    }


def _is_done(job: PretokenizeJob, index: int, num_shards: int, tokenizer_sha: str) -> bool:
    """Whether shard ``index`` was finished by a run of the same job (input and tokenizer)."""
    bin_path, idx_path, done_path = shard_files(Path(job.out_dir), index)
    if not (done_path.is_file() and bin_path.is_file() and idx_path.is_file()):
        return False
    marker = json.loads(done_path.read_text())
    same_source = marker.get("source") == _source(job, num_shards)
    return same_source and marker.get("tokenizer_sha256") == tokenizer_sha


class _Progress:
    """A progress bar of tokens written, with tokens/s."""

    def __init__(self, show: bool) -> None:
        from tqdm import tqdm

        self.bar = tqdm(unit="tok", unit_scale=True, disable=not show, desc="pretokenize")
        self.start, self.total = time.perf_counter(), 0

    def put(self, n: int) -> None:
        self.total += n
        self.bar.update(n)
        rate = self.total / max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix(tok_per_s=f"{rate:,.0f}", refresh=False)

    def drain(self, queue: Any, results: list[Any]) -> None:
        """Take the workers' token counts until every worker has finished."""
        while not all(r.ready() for r in results) or not queue.empty():
            try:
                self.put(queue.get(timeout=0.2))
            except Empty:
                continue


def _run(job: PretokenizeJob, todo: list[int], num_shards: int, show: bool) -> None:
    """Write the shards ``todo``: in this process, or over ``job.workers`` worker processes."""
    progress = _Progress(show)
    try:
        if job.workers <= 1 or len(todo) <= 1:
            for k in todo:
                _write_shard(job, k, num_shards, progress)
            return
        ctx = mp.get_context("spawn")
        with ctx.Manager() as manager, ctx.Pool(min(job.workers, len(todo))) as pool:
            queue = manager.Queue()
            results = [pool.apply_async(_write_shard, (job, k, num_shards, queue)) for k in todo]
            progress.drain(queue, results)
            for r in results:
                r.get()  # re-raises a worker's error
    finally:
        progress.bar.close()


def pretokenize(job: PretokenizeJob, show_progress: bool = True) -> dict[str, Any]:
    """Tokenize ``job``'s dataset into ``job.out_dir``; returns the manifest it wrote."""
    out = Path(job.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(job.tokenizer_path)
    ident = tokenizer_identity(tokenizer)
    data, _ = load_text_dataset(job.dataset, job.dataset_path, job.split)
    num_shards = max(int(data.num_shards), 1)
    todo = [k for k in range(num_shards) if not _is_done(job, k, num_shards, ident["sha256"])]
    stale = [p for p in out.glob("shard_*.done") if int(p.stem.split("_")[1]) >= num_shards]
    if stale:
        raise ValueError(
            f"{out} holds shards of another input ({stale[0].name}: this input has "
            f"{num_shards} files); write to an empty folder"
        )
    if todo:
        (out / MANIFEST).unlink(missing_ok=True)
    _run(job, todo, num_shards, show_progress)
    shards = [verify_shard(out, k, tokenizer) for k in range(num_shards)]
    manifest = {
        "format": FORMAT,
        "source": _source(job, num_shards),
        "tokenizer": ident,
        "dtype": token_dtype(tokenizer.vocab_size).name,
        "total_tokens": sum(s["tokens"] for s in shards),
        "total_documents": sum(s["documents"] for s in shards),
        "shards": [{"tokens": s["tokens"], "documents": s["documents"]} for s in shards],
    }
    tmp = out / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, out / MANIFEST)
    return manifest
