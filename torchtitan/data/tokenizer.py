"""Byte-level BPE tokenizer on top of tiktoken.

The model file is a tiktoken "ranks" file: one line per token, ``base64(token bytes) rank``, the
256 single bytes first (ranks 0..255) and then the merged tokens in merge order. Such a file is
written by ``scripts/train_tokenizer.py``; Llama-3-style ``tokenizer.model`` files have the same
format. The special tokens are not in the file: they are appended here, after the ranks, so
``vocab_size == len(ranks) + len(special tokens)``.

Text is pre-split with :data:`SPLIT_PATTERN` (the same pattern the trainer uses) and each piece is
BPE-encoded, so any Unicode string round-trips: ``decode(encode(s, bos=False, eos=False)) == s``.
Special-token strings that occur in ordinary text are encoded as ordinary text, never as the
special ids, so a document cannot forge a BOS/EOS.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

import tiktoken
from tiktoken.load import load_tiktoken_bpe

from torchtitan.data.hf_tokenizer import HF_TOKENIZER_FILENAME, HFTokenizer
from torchtitan.tools.paths import resolve_repo_path

__all__ = [
    "BOS_TOKEN",
    "EOS_TOKEN",
    "NUM_RESERVED_SPECIAL_TOKENS",
    "SPLIT_PATTERN",
    "TOKENIZER_FILENAME",
    "TextTokenizer",
    "Tokenizer",
    "build_tokenizer",
]

# Pre-tokenization split in the style of GPT-4's tokenizer: English contractions, runs of letters
# (with one leading non-letter such as a space), numbers in groups of at most three digits,
# punctuation runs (with an optional leading space), newlines, and other whitespace. Possessive
# quantifiers (``?+``, ``++``) keep the matching linear; both tiktoken and ``regex`` accept them.
SPLIT_PATTERN = (
    r"'(?i:[sdmt]|ll|ve|re)"
    r"|[^\r\n\p{L}\p{N}]?+\p{L}+"
    r"|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]++[\r\n]*"
    r"|\s*[\r\n]"
    r"|\s+(?!\S)"
    r"|\s+"
)

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
NUM_RESERVED_SPECIAL_TOKENS = 6
TOKENIZER_FILENAME = "tokenizer.model"

_TRAIN_HINT = (
    "Train one with `python scripts/train_tokenizer.py <corpus> --output <dir>/tokenizer.model` "
    "or point `model.tokenizer_path` at an existing tiktoken ranks file "
    "(the shipped test tokenizer is tests/assets/tokenizer)."
)


class TextTokenizer(Protocol):
    """What the data pipeline and generation use of a tokenizer: the tiktoken
    :class:`Tokenizer` and the Hugging Face ``HFTokenizer`` both satisfy it."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_id(self) -> int: ...

    def encode(self, text: str, bos: bool = True, eos: bool = True) -> list[int]: ...

    def encode_batch(
        self, texts: list[str], bos: bool = True, eos: bool = True
    ) -> list[list[int]]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


class Tokenizer:
    """tiktoken ``Encoding`` built from a local ranks file, plus BOS/EOS and reserved specials.

    Args:
        model_path: the ranks file (see the module docstring).
    """

    def __init__(self, model_path: str | Path) -> None:
        self.model_path = Path(model_path)
        raw = self.model_path.read_bytes()
        try:
            # tiktoken caches every file it reads, keyed by the *path*, under
            # $TIKTOKEN_CACHE_DIR (default: <tmp>/data-gym-cache). Passing the content hash
            # makes it discard a stale cached copy when the file at that path has changed.
            ranks = load_tiktoken_bpe(str(self.model_path), hashlib.sha256(raw).hexdigest())
        except ValueError as e:
            raise ValueError(
                f"{self.model_path} is not a tiktoken ranks file (expected lines of "
                f"'<base64 token> <rank>'; a HF tokenizer.json must end in .json). "
                f"{_TRAIN_HINT}"
            ) from e
        n = len(ranks)
        if n < 256 or sorted(ranks.values()) != list(range(n)):
            raise ValueError(
                f"{self.model_path}: ranks must be exactly 0..{n - 1} without gaps or repeats "
                f"and include all 256 single bytes (got {n} tokens). {_TRAIN_HINT}"
            )
        missing = [b for b in range(256) if bytes([b]) not in ranks]
        if missing:
            raise ValueError(
                f"{self.model_path}: {len(missing)} of the 256 single-byte tokens are missing "
                f"(first: {missing[0]}), so some text could not be encoded. {_TRAIN_HINT}"
            )
        specials = [BOS_TOKEN, EOS_TOKEN] + [
            f"<|reserved_special_token_{i}|>" for i in range(NUM_RESERVED_SPECIAL_TOKENS)
        ]
        self.special_tokens: dict[str, int] = {tok: n + i for i, tok in enumerate(specials)}
        self.num_base_tokens = n
        self._encoding = tiktoken.Encoding(
            name=self.model_path.name,
            pat_str=SPLIT_PATTERN,
            mergeable_ranks=ranks,
            special_tokens=self.special_tokens,
        )

    @property
    def vocab_size(self) -> int:
        """Ranks in the file plus the special tokens; the model's embedding size."""
        return self._encoding.n_vocab

    @property
    def bos_id(self) -> int:
        return self.special_tokens[BOS_TOKEN]

    @property
    def eos_id(self) -> int:
        return self.special_tokens[EOS_TOKEN]

    def encode(self, text: str, bos: bool = True, eos: bool = True) -> list[int]:
        """Token ids of ``text``, with BOS first and/or EOS last if asked."""
        ids = self._encoding.encode_ordinary(text)
        if bos:
            ids.insert(0, self.bos_id)
        if eos:
            ids.append(self.eos_id)
        return ids

    def encode_batch(self, texts: list[str], bos: bool = True, eos: bool = True) -> list[list[int]]:
        """:meth:`encode` for many texts at once (tiktoken encodes them on several threads)."""
        out = self._encoding.encode_ordinary_batch(texts)
        prefix, suffix = [self.bos_id] if bos else [], [self.eos_id] if eos else []
        return [prefix + ids + suffix for ids in out]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` (a list, or anything with ``tolist()`` such as a tensor). Special ids
        decode to their names; byte sequences that are not valid UTF-8 become U+FFFD."""
        tolist = getattr(ids, "tolist", None)
        seq = tolist() if callable(tolist) else list(ids)
        return self._encoding.decode(seq)

    def __repr__(self) -> str:
        return f"Tokenizer(path={str(self.model_path)!r}, vocab_size={self.vocab_size})"


def build_tokenizer(path: str | Path | None) -> Tokenizer | HFTokenizer:
    """Tokenizer from ``path``: a ranks file, or a directory holding ``tokenizer.model``; a
    Hugging Face ``tokenizer.json`` (or a directory holding one and no ``tokenizer.model``)
    gives an :class:`HFTokenizer` (``data/hf_tokenizer.py``).

    A relative path that does not exist from the working directory is looked up under the
    repository root. Raises ``FileNotFoundError`` (missing) or ``ValueError`` (empty path or not
    a ranks file), each naming the path and how to fix it.
    """
    if path is None or str(path).strip() == "":
        raise ValueError(f"model.tokenizer_path is empty. {_TRAIN_HINT}")
    resolved = resolve_repo_path(path)
    if resolved.is_dir():
        candidate = resolved / TOKENIZER_FILENAME
        if not candidate.is_file() and (resolved / HF_TOKENIZER_FILENAME).is_file():
            return HFTokenizer(resolved / HF_TOKENIZER_FILENAME)
        if not candidate.is_file():
            raise FileNotFoundError(
                f"model.tokenizer_path={str(path)!r} is a directory without a "
                f"{TOKENIZER_FILENAME} or {HF_TOKENIZER_FILENAME} (looked for {candidate}). "
                f"{_TRAIN_HINT}"
            )
        resolved = candidate
    elif not resolved.is_file():
        raise FileNotFoundError(
            f"model.tokenizer_path={str(path)!r} does not exist (looked in the working directory "
            f"and the repository root). {_TRAIN_HINT}"
        )
    if resolved.suffix == ".json":
        return HFTokenizer(resolved)
    return Tokenizer(resolved)


AnyTokenizer = Tokenizer | HFTokenizer
"""What ``build_tokenizer`` returns: a tiktoken ranks file or a Hugging Face tokenizer.json."""
