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

A damaged corpus (a manifest that is not this format, a shard whose size or document index
disagrees with the manifest, a token id outside the vocabulary) is a :class:`CorpusError`: a
``DataError`` naming the config field and the file, which entry points print as one line
(docs/errors.md). Opening checks the manifest and each shard's size and index ends; a flipped
token is found when its window is read.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from torchtitan.data.checks import DataError
from torchtitan.data.tokenizer import AnyTokenizer

MANIFEST = "manifest.json"
FORMAT = "torchtitan-tokens-v1"

__all__ = [
    "FORMAT",
    "CorpusError",
    "MANIFEST",
    "TokenCorpus",
    "check_manifest",
    "read_manifest",
    "shard_files",
    "token_dtype",
    "tokenizer_identity",
]

FIELD = "training.dataset_path"
_FIX = "pretokenize it again (scripts/pretokenize.py) or point the option at an intact corpus"
_DTYPES = ("uint16", "uint32")


class CorpusError(DataError):
    """A missing or damaged pretokenized corpus: the field, the corpus folder and the file."""

    def __init__(self, folder: str | Path, file: str | Path, rule: str, field: str = FIELD):
        super().__init__(field, str(folder), rule, _FIX, file)


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


def read_manifest(folder: str | Path, field: str = FIELD) -> dict[str, Any]:
    """The manifest of a corpus folder, checked for shape; a :class:`CorpusError` otherwise."""
    path = Path(folder) / MANIFEST
    if not Path(folder).is_dir():
        raise CorpusError(
            folder, folder, "is not a folder (expected a corpus of scripts/pretokenize.py)", field
        )
    if not path.is_file():
        raise CorpusError(
            folder,
            folder,
            f"has no {MANIFEST}: not a finished scripts/pretokenize.py output (a killed run "
            "resumes when started again with the same arguments)",
            field,
        )
    try:
        manifest = json.loads(path.read_bytes())
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise CorpusError(folder, path, f"is not JSON ({e})", field) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise CorpusError(folder, path, f"format {got!r}, expected {FORMAT!r}", field)
    why = _manifest_fault(manifest)
    if why:
        raise CorpusError(folder, path, why, field)
    return manifest


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _manifest_fault(m: dict[str, Any]) -> str | None:
    """What is wrong with a manifest's fields (None: nothing)."""
    tok, shards = m.get("tokenizer"), m.get("shards")
    if m.get("dtype") not in _DTYPES:
        return f"dtype {m.get('dtype')!r} is not one of {', '.join(_DTYPES)}"
    if not isinstance(tok, dict) or not all(_count(tok.get(k)) for k in ("vocab_size", "eos_id")):
        return "'tokenizer' lacks integer vocab_size and eos_id"
    if not isinstance(shards, list) or not all(
        isinstance(x, dict) and _count(x.get("tokens")) and _count(x.get("documents"))
        for x in shards
    ):
        return "'shards' is not a list of {tokens, documents} counts"
    if m.get("total_tokens") != sum(x["tokens"] for x in shards):
        return f"total_tokens {m.get('total_tokens')!r} is not the sum of the shards' tokens"
    return None


def check_manifest(
    folder: str | Path, manifest: dict[str, Any], tokenizer: AnyTokenizer, field: str = FIELD
) -> None:
    """CorpusError unless the corpus was made with this tokenizer and every shard is complete."""
    ident, want = manifest["tokenizer"], tokenizer_identity(tokenizer)
    diff = [k for k in want if ident.get(k) != want[k]]
    if diff:
        raise CorpusError(
            folder,
            Path(folder) / MANIFEST,
            f"{folder} was tokenized with another tokenizer ({', '.join(diff)} differ: corpus "
            f"{ {k: ident.get(k) for k in diff} }, model.tokenizer_path "
            f"{ {k: want[k] for k in diff} }); pretokenize it again with this tokenizer",
            field,
        )
    for k in range(len(manifest["shards"])):
        check_shard(folder, manifest, k, field)


def check_shard(folder: str | Path, manifest: dict[str, Any], k: int, field: str = FIELD) -> None:
    """Shard ``k``'s files exist and their sizes agree with the (checked) manifest."""
    shard, itemsize = manifest["shards"][k], np.dtype(manifest["dtype"]).itemsize
    bin_path, idx_path, _ = shard_files(Path(folder), k)
    for path in (bin_path, idx_path):
        if not path.is_file():
            raise CorpusError(folder, path, f"shard {k} is missing", field)
    if bin_path.stat().st_size != shard["tokens"] * itemsize:
        raise CorpusError(
            folder,
            bin_path,
            f"{bin_path.stat().st_size} bytes, the manifest says {shard['tokens']} tokens of "
            f"{manifest['dtype']}; the corpus is damaged",
            field,
        )


def _doc_index(folder: Path, manifest: dict[str, Any], k: int, field: str) -> np.ndarray:
    """Shard ``k``'s document starts (memory-mapped): ``documents + 1`` int64 from 0 to the
    shard's token count."""
    shard, path = manifest["shards"][k], shard_files(folder, k)[1]
    try:
        starts = np.load(path, mmap_mode="r", allow_pickle=False)
    except Exception as e:  # numpy parses the header: ValueError, SyntaxError, EOFError, ...
        raise CorpusError(folder, path, f"is not a .npy document index ({e})", field) from None
    if (
        starts.dtype != np.int64
        or starts.shape != (shard["documents"] + 1,)
        or starts[0] != 0
        or starts[-1] != shard["tokens"]
    ):
        raise CorpusError(
            folder,
            path,
            f"is not {shard['documents'] + 1} int64 document starts from 0 to "
            f"{shard['tokens']} (got {starts.dtype} of shape {starts.shape}); it is damaged",
            field,
        )
    return starts


class TokenCorpus:
    """A pre-tokenized corpus opened by memory map: token ranges and document ids by offset.

    Opening reads the manifest and the per-shard document indexes (int64, 8 bytes a document),
    never the tokens; :meth:`read` maps only the pages of the range it returns.
    """

    def __init__(
        self, folder: str | Path, tokenizer: AnyTokenizer | None = None, field: str = FIELD
    ) -> None:
        self.folder, self.field = Path(folder), field
        self.manifest = manifest = read_manifest(folder, field)
        if tokenizer is not None:
            check_manifest(folder, manifest, tokenizer, field)
        self.dtype = np.dtype(manifest["dtype"])
        self.eos_id = int(manifest["tokenizer"]["eos_id"])
        self.vocab_size = int(manifest["tokenizer"]["vocab_size"])
        order = [k for k, s in enumerate(manifest["shards"]) if s["tokens"] > 0]
        for k in order:
            check_shard(self.folder, manifest, k, field)
        self._paths = [shard_files(self.folder, k)[0] for k in order]
        self._tokens = [np.memmap(p, self.dtype, "r") for p in self._paths]
        # Per-shard document starts, memory-mapped too: opening costs O(shards), not O(docs).
        self._starts = [_doc_index(self.folder, manifest, k, field) for k in order]
        sizes = np.array([len(t) for t in self._tokens], dtype=np.int64)
        self.shard_starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.num_tokens = int(self.shard_starts[-1])
        self.num_docs = int(sum(s["documents"] for s in manifest["shards"]))
        if self.num_tokens == 0:
            raise CorpusError(folder, Path(folder) / MANIFEST, "the corpus holds no tokens", field)

    def doc_bounds(self) -> np.ndarray:
        """Global document start offsets plus the corpus end (int64, ``num_docs + 1``); reads
        every shard's index (O(documents)): only document shuffling needs it."""
        for starts, path in zip(self._starts, self._paths):
            if np.any(np.diff(starts) < 0):
                raise CorpusError(
                    self.folder, path, "document index is not increasing; it is damaged", self.field
                )
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
            toks.append(self._checked(k, self._tokens[k][pos - base : end - base]))
            idx = self._starts[k]
            lo, hi = np.searchsorted(idx, [pos - base, end - base])
            marks.append(np.asarray(idx[lo:hi], dtype=np.int64) + (base - start))
            pos, k = end, k + 1
        return np.concatenate(toks), np.concatenate(marks)

    def _checked(self, k: int, tokens: np.ndarray) -> np.ndarray:
        """``tokens`` of shard ``k``, unless an id is outside the vocabulary (a flipped bit)."""
        if len(tokens) and int(tokens.max()) >= self.vocab_size:
            raise CorpusError(
                self.folder,
                self._paths[k],
                f"holds token id {int(tokens.max())} >= vocab_size {self.vocab_size}; "
                "it is damaged",
                self.field,
            )
        return tokens

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
