"""The on-disk format of pre-tokenized corpora and its reader (docs/data.md).

A corpus folder holds, per shard ``k`` (one per input file of the text dataset, in its order):

- ``shard_<k>.bin``: the tokens of its documents, each ``[BOS, *tokens, EOS]``, concatenated,
  as a flat little-endian array of ``dtype`` (uint16 when the vocabulary fits, else uint32);
- ``shard_<k>.idx.npy``: int64 document start offsets into the shard, ``n_docs + 1`` entries
  (the last is the shard's token count);
- ``shard_<k>.done``: the completion marker (JSON: counts and the ``.bin``'s SHA-256),

and ``manifest.json`` with the tokenizer's identity, the dtype and every shard's counts. The
corpus is the concatenation of its shards in order: exactly the token stream the text path
(``data/dataloader.py``) builds from the same documents.

:class:`TokenCorpus` opens it by memory map and reads any token range of the corpus repeated
forever (epoch ``e`` covers tokens ``[e*N, (e+1)*N)``) with its document ids, touching only the
pages of that range.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from torchtitan.data.tokenizer import AnyTokenizer

MANIFEST = "manifest.json"
FORMAT = "torchtitan-tokens-v1"

__all__ = [
    "FORMAT",
    "MANIFEST",
    "TokenCorpus",
    "check_manifest",
    "read_manifest",
    "shard_files",
    "token_dtype",
    "tokenizer_identity",
]


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every token id."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def tokenizer_identity(tokenizer: AnyTokenizer) -> dict[str, Any]:
    """What makes two tokenizers give the same ids: the ranks file's hash and the specials."""
    return {
        "file": tokenizer.model_path.name,
        "sha256": hashlib.sha256(tokenizer.model_path.read_bytes()).hexdigest(),
        "vocab_size": tokenizer.vocab_size,
        "bos_id": tokenizer.bos_id,
        "eos_id": tokenizer.eos_id,
    }


def shard_files(folder: Path, index: int) -> tuple[Path, Path, Path]:
    """(tokens .bin, document index .idx.npy, completion marker .done) of shard ``index``."""
    stem = folder / f"shard_{index:05d}"
    return stem.with_suffix(".bin"), Path(f"{stem}.idx.npy"), stem.with_suffix(".done")


def read_manifest(folder: str | Path) -> dict[str, Any]:
    """The manifest of a corpus folder, or a ValueError that says what is wrong."""
    path = Path(folder) / MANIFEST
    if not Path(folder).is_dir():
        raise ValueError(f"{folder} is not a folder (expected a corpus of scripts/pretokenize.py)")
    if not path.is_file():
        raise ValueError(
            f"{folder} has no {MANIFEST}: not a finished scripts/pretokenize.py output "
            f"(a killed run resumes when started again with the same arguments)"
        )
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


def check_manifest(folder: str | Path, manifest: dict[str, Any], tokenizer: AnyTokenizer) -> None:
    """ValueError unless the corpus was made with this tokenizer and every shard is complete."""
    ident, want = manifest["tokenizer"], tokenizer_identity(tokenizer)
    diff = [k for k in want if ident.get(k) != want[k]]
    if diff:
        raise ValueError(
            f"{folder} was tokenized with another tokenizer ({', '.join(diff)} differ: corpus "
            f"{ {k: ident.get(k) for k in diff} }, model.tokenizer_path "
            f"{ {k: want[k] for k in diff} }); pretokenize it again with this tokenizer"
        )
    itemsize = np.dtype(manifest["dtype"]).itemsize
    for k, shard in enumerate(manifest["shards"]):
        bin_path, idx_path, _ = shard_files(Path(folder), k)
        if not bin_path.is_file() or not idx_path.is_file():
            raise ValueError(f"{folder}: shard {k} is missing ({bin_path.name}/{idx_path.name})")
        if bin_path.stat().st_size != shard["tokens"] * itemsize:
            raise ValueError(
                f"{bin_path}: {bin_path.stat().st_size} bytes, the manifest says "
                f"{shard['tokens']} tokens of {manifest['dtype']}; the corpus is damaged"
            )


class TokenCorpus:
    """A pre-tokenized corpus opened by memory map: token ranges and document ids by offset.

    Opening reads the manifest and the per-shard document indexes (int64, 8 bytes a document),
    never the tokens; :meth:`read` maps only the pages of the range it returns.
    """

    def __init__(self, folder: str | Path, tokenizer: AnyTokenizer | None = None) -> None:
        self.folder = Path(folder)
        self.manifest = manifest = read_manifest(folder)
        if tokenizer is not None:
            check_manifest(folder, manifest, tokenizer)
        self.dtype = np.dtype(manifest["dtype"])
        self.eos_id = int(manifest["tokenizer"]["eos_id"])
        order = [k for k, s in enumerate(manifest["shards"]) if s["tokens"] > 0]
        self._tokens = [np.memmap(shard_files(self.folder, k)[0], self.dtype, "r") for k in order]
        # Per-shard document starts, memory-mapped too: opening costs O(shards), not O(docs).
        self._starts = [np.load(shard_files(self.folder, k)[1], mmap_mode="r") for k in order]
        sizes = np.array([len(t) for t in self._tokens], dtype=np.int64)
        self.shard_starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.num_tokens = int(self.shard_starts[-1])
        self.num_docs = int(sum(s["documents"] for s in manifest["shards"]))
        if self.num_tokens == 0:
            raise ValueError(f"{folder}: the corpus holds no tokens")

    def doc_bounds(self) -> np.ndarray:
        """Global document start offsets plus the corpus end (int64, ``num_docs + 1``); reads
        every shard's index (O(documents)): only document shuffling needs it."""
        parts = [s[:-1] + base for s, base in zip(self._starts, self.shard_starts)]
        return np.concatenate([*parts, [self.num_tokens]]).astype(np.int64)

    def _flat(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens ``[start, stop)`` of one pass (``0 <= start < stop <= num_tokens``) and the
        positions (relative to ``start``) where a document starts."""
        toks, marks = [], []
        k = int(np.searchsorted(self.shard_starts, start, side="right")) - 1
        pos = start
        while pos < stop:
            base = int(self.shard_starts[k])
            end = min(stop, int(self.shard_starts[k + 1]))
            toks.append(self._tokens[k][pos - base : end - base])
            idx = self._starts[k]
            lo, hi = np.searchsorted(idx, [pos - base, end - base])
            marks.append(np.asarray(idx[lo:hi], dtype=np.int64) + (base - start))
            pos, k = end, k + 1
        return np.concatenate(toks), np.concatenate(marks)

    def read(self, start: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        """``length`` tokens from offset ``start`` of the corpus repeated forever (int64), and
        their document ids (int32: 0 for the range's first document, one more at each later
        document start; docs/attention.md)."""
        toks, marks, n, done = [], [], self.num_tokens, 0
        while done < length:
            pos = (start + done) % n
            take = min(length - done, n - pos)
            t, m = self._flat(pos, pos + take)
            toks.append(t)
            marks.append(m + done)
            done += take
        return np.concatenate(toks).astype(np.int64), _doc_ids(np.concatenate(marks), length)

    def read_docs(self, spans: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        """The concatenation of global token ranges ``[a, b)`` (documents, or parts of them, in
        any order) and its document ids, each span starting a new document id."""
        toks = [self._flat(a, b)[0] for a, b in spans]
        lengths = np.array([b - a for a, b in spans], dtype=np.int64)
        marks = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        return np.concatenate(toks).astype(np.int64), _doc_ids(marks, int(lengths.sum()))


def _doc_ids(starts: np.ndarray, length: int) -> np.ndarray:
    is_start = np.zeros(length, dtype=np.int32)
    is_start[starts[(starts > 0) & (starts < length)]] = 1
    return np.cumsum(is_start, dtype=np.int32)
