"""Synthetic arithmetic data for post-training (docs/posttrain.md):

    python scripts/make_posttrain_data.py OUT_DIR [--n 200] [--seed 0] [--max 9]

writes to ``OUT_DIR``:

- ``sft.jsonl``: chat conversations "What is a+b?" -> "c" (the ``chat`` dataset, docs/sft.md);
- ``preference.jsonl``: the same prompts with the right sum as ``chosen`` and a wrong one as
  ``rejected`` (DPO);
- ``prompts.jsonl``: ``{"prompt": ..., "answer": "c"}`` for GRPO's exact-match reward.

Operands are drawn from ``0..max`` by a seeded generator, so the same arguments give the same
files.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def problems(n: int, seed: int, top: int) -> list[tuple[str, str, str]]:
    """(question, right answer, a wrong answer) for ``n`` sums."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, top), rng.randint(0, top)
        wrong = a + b + rng.choice([-2, -1, 1, 2])
        out.append(
            (f"What is {a}+{b}?", str(a + b), str(max(wrong, 0) if wrong != a + b else wrong + 1))
        )
    return out


def write(out: Path, n: int, seed: int, top: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rows = problems(n, seed, top)
    with open(out / "sft.jsonl", "w") as f:
        for q, a, _ in rows:
            msgs = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            f.write(json.dumps({"messages": msgs}) + "\n")
    with open(out / "preference.jsonl", "w") as f:
        for q, a, w in rows:
            f.write(json.dumps({"prompt": q, "chosen": a, "rejected": w}) + "\n")
    with open(out / "prompts.jsonl", "w") as f:
        for q, a, _ in rows:
            f.write(json.dumps({"prompt": q, "answer": a}) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("out", type=Path)
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max", type=int, default=9, help="largest operand")
    a = p.parse_args(argv)
    write(a.out, a.n, a.seed, a.max)
    print(f"wrote {a.n} problems to {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
