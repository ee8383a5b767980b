"""Tokenize a text dataset once into memory-mapped token shards for ``training.dataset =
"tokenized"`` (docs/data.md).

    python scripts/pretokenize.py --dataset test_corpus --split train \
        --tokenizer tests/assets/tokenizer --out /tmp/test_corpus_tokens --workers 4

The input is anything ``training.dataset``/``dataset_path`` accepts (a registered name, a local
JSONL/parquet/text file or folder, a hub dataset id). One shard per input file, written by
worker processes; run it again after a kill and only unfinished shards are redone. Every shard
is verified before ``manifest.json`` is written.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from torchtitan.data.pretokenize import PretokenizeJob, pretokenize  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dataset", default="test_corpus", help="as training.dataset")
    ap.add_argument("--dataset-path", default=None, help="as training.dataset_path")
    ap.add_argument("--split", default="train")
    ap.add_argument("--tokenizer", default="tests/assets/tokenizer", help="model.tokenizer_path")
    ap.add_argument("--out", required=True, help="output folder of the corpus")
    ap.add_argument("--workers", type=int, default=1, help="worker processes (one file each)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    job = PretokenizeJob(
        dataset=args.dataset,
        dataset_path=args.dataset_path,
        split=args.split,
        tokenizer_path=args.tokenizer,
        out_dir=args.out,
        workers=args.workers,
    )
    manifest = pretokenize(job, show_progress=not args.no_progress)
    print(
        f"{args.out}: {manifest['total_tokens']:,} tokens, {manifest['total_documents']:,} "
        f"documents in {len(manifest['shards'])} shard(s) of {manifest['dtype']}; verified"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
