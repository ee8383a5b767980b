"""Train a byte-level BPE tokenizer and write it as a tiktoken ranks file.

tiktoken can only *use* a BPE vocabulary (it has no trainer), so this script learns one. The
result loads with ``torchtitan.data.tokenizer.build_tokenizer``.

How it works:

1. Every text is split with the same pre-tokenization pattern the tokenizer uses
   (``SPLIT_PATTERN``, GPT-4 style), and the distinct pieces ("word types") are counted. Merges
   never cross piece boundaries, so training only needs the word types and their counts, which
   makes it independent of corpus size after counting.
2. Each word type starts as its UTF-8 bytes (tokens 0..255). Repeatedly, the most frequent
   adjacent pair of tokens (frequency weighted by word counts; ties broken by the token bytes so
   the output is deterministic) is merged into a new token. Pair counts are updated only for the
   words that contain the merged pair, and a max-heap with lazy invalidation picks the next pair,
   so 2k merges over a few MB take seconds.
3. The ranks file lists ``base64(token bytes) rank`` per line: the 256 single bytes first
   (rank = byte value), then the merged tokens in the order they were learned.

Inputs: ``.jsonl``/``.json`` files (one JSON object per line; the ``--text-field`` is used),
``.txt`` files (the whole file is one text), or directories holding such files.

Usage::

    python scripts/train_tokenizer.py tests/assets/test_corpus/train.jsonl \\
        --vocab-size 2040 --output tests/assets/tokenizer/tokenizer.model

``--vocab-size`` counts the ranks (the 256 bytes included); the tokenizer appends its special
tokens after them (8 of them: 2040 ranks give a 2048-token vocabulary).
"""

from __future__ import annotations

import argparse
import base64
import heapq
import json
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

import regex

from torchtitan.data.tokenizer import SPLIT_PATTERN

Pair = tuple[int, int]


def iter_texts(paths: Iterable[str | Path], text_field: str = "text") -> Iterator[str]:
    """Texts from .jsonl/.json/.txt files, or directories of them (sorted, recursive)."""
    for root in paths:
        root = Path(root)
        if root.is_dir():
            files = sorted(p for p in root.rglob("*") if p.suffix in (".jsonl", ".json", ".txt"))
        elif root.is_file():
            files = [root]
        else:
            raise FileNotFoundError(f"corpus path {str(root)!r} does not exist")
        for f in files:
            if f.suffix == ".txt":
                yield f.read_text(encoding="utf-8")
                continue
            with f.open(encoding="utf-8") as fh:
                for line in fh:
                    if line.strip():
                        yield json.loads(line)[text_field]


def count_words(texts: Iterable[str], pattern: str = SPLIT_PATTERN) -> Counter[bytes]:
    """Counts of the pre-tokenized pieces of all texts, as UTF-8 bytes."""
    split = regex.compile(pattern)
    counts: Counter[str] = Counter()
    for text in texts:
        counts.update(split.findall(text))
    return Counter({w.encode("utf-8"): c for w, c in counts.items()})


def train_bpe(
    word_counts: Counter[bytes], vocab_size: int, min_frequency: int = 2
) -> dict[bytes, int]:
    """Learn merges until there are ``vocab_size`` tokens (or no pair occurs ``min_frequency``
    times). Returns the ranks: token bytes -> rank, the 256 single bytes first."""
    if vocab_size < 256:
        raise ValueError(f"vocab_size must be at least 256 (the single bytes), got {vocab_size}")
    vocab: list[bytes] = [bytes([b]) for b in range(256)]
    ranks: dict[bytes, int] = {tok: i for i, tok in enumerate(vocab)}
    words: list[list[int]] = [list(w) for w in word_counts]
    freqs: list[int] = list(word_counts.values())

    pair_counts: Counter[Pair] = Counter()
    where: dict[Pair, set[int]] = {}
    for i, (w, f) in enumerate(zip(words, freqs)):
        for pair in zip(w, w[1:]):
            pair_counts[pair] += f
            where.setdefault(pair, set()).add(i)

    def entry(pair: Pair) -> tuple[int, bytes, bytes, Pair]:
        return (-pair_counts[pair], vocab[pair[0]], vocab[pair[1]], pair)

    heap = [entry(p) for p in pair_counts]
    heapq.heapify(heap)
    while len(vocab) < vocab_size and heap:
        neg, _, _, pair = heapq.heappop(heap)
        if -neg != pair_counts.get(pair, 0):
            continue  # stale entry: the count changed after it was pushed
        if -neg < min_frequency:
            break
        a, b = pair
        merged = vocab[a] + vocab[b]
        new_id = ranks.get(merged)  # the same bytes may already exist from another merge order
        if new_id is None:
            new_id = len(vocab)
            vocab.append(merged)
            ranks[merged] = new_id
        changed: set[Pair] = set()
        for i in sorted(where.pop(pair, ())):
            w, f = words[i], freqs[i]
            if len(w) < 2:
                continue
            out: list[int] = []
            j = 0
            while j < len(w):
                if j + 1 < len(w) and w[j] == a and w[j + 1] == b:
                    out.append(new_id)
                    j += 2
                else:
                    out.append(w[j])
                    j += 1
            if len(out) == len(w):
                continue  # stale index: the pair left this word in an earlier merge
            for p in zip(w, w[1:]):
                pair_counts[p] -= f
                changed.add(p)
            for p in zip(out, out[1:]):
                pair_counts[p] += f
                where.setdefault(p, set()).add(i)
                changed.add(p)
            words[i] = out
        pair_counts.pop(pair, None)
        for p in changed:
            if pair_counts.get(p, 0) > 0:
                heapq.heappush(heap, entry(p))
            else:
                pair_counts.pop(p, None)
    return ranks


def write_ranks(ranks: dict[bytes, int], path: str | Path) -> None:
    """Write ``ranks`` in tiktoken's format, ordered by rank."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [
        f"{base64.b64encode(tok).decode('ascii')} {r}\n"
        for tok, r in sorted(ranks.items(), key=lambda kv: kv[1])
    ]
    path.write_text("".join(lines), encoding="ascii")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("inputs", nargs="+", help=".jsonl/.json/.txt files or directories of them")
    ap.add_argument(
        "--output", required=True, help="ranks file to write (e.g. <dir>/tokenizer.model)"
    )
    ap.add_argument(
        "--vocab-size", type=int, default=2040, help="ranks incl. the 256 bytes (default 2040)"
    )
    ap.add_argument(
        "--text-field", default="text", help="JSON field holding the text (default: text)"
    )
    ap.add_argument("--min-frequency", type=int, default=2, help="stop when the best pair is rarer")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    counts = count_words(iter_texts(args.inputs, args.text_field))
    t1 = time.perf_counter()
    ranks = train_bpe(counts, args.vocab_size, args.min_frequency)
    t2 = time.perf_counter()
    write_ranks(ranks, args.output)
    n_bytes = sum(len(w) * c for w, c in counts.items())
    print(
        f"{sum(counts.values())} pieces ({len(counts)} distinct, {n_bytes} bytes) counted in {t1 - t0:.2f}s; "
        f"{len(ranks) - 256} merges in {t2 - t1:.2f}s; wrote {len(ranks)} ranks to {args.output}"
    )
    if len(ranks) < args.vocab_size:
        print(
            f"note: stopped at {len(ranks)} < {args.vocab_size}: no pair occurs {args.min_frequency}+ times"
        )


if __name__ == "__main__":
    main()
