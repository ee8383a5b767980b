"""Write a small synthetic chat dataset (JSONL ``messages``) for tests and the SFT debug config.

The conversations are generated from a seed, so the shipped files can be re-made exactly::

    python scripts/make_chat_dataset.py --output tests/assets/chat

Tasks are simple enough for the debug model to learn in a few dozen steps (arithmetic,
repeating and reversing words, counting), with an optional system turn and one to three
user/assistant exchanges, so the conversations have uneven lengths and uneven numbers of
assistant tokens.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

WORDS = (
    "apple",
    "river",
    "stone",
    "cloud",
    "green",
    "quiet",
    "tiger",
    "paper",
    "window",
    "orange",
    "silver",
    "forest",
    "candle",
    "music",
    "winter",
    "garden",
    "bridge",
    "rocket",
    "planet",
    "yellow",
)
SYSTEMS = (
    "You are a helpful assistant.",
    "You are a terse assistant. Answer in one sentence.",
    "Answer the question exactly.",
)


def _exchange(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(4)
    if kind == 0:
        a, b = rng.randrange(100), rng.randrange(100)
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    if kind == 1:
        words = rng.sample(WORDS, rng.randrange(2, 6))
        return f"Repeat after me: {' '.join(words)}", " ".join(words)
    if kind == 2:
        word = rng.choice(WORDS)
        return f"Spell {word} backwards.", f"{word} backwards is {word[::-1]}."
    words = rng.sample(WORDS, rng.randrange(1, 8))
    return f"How many words are in: {' '.join(words)}?", f"There are {len(words)} words."


def conversation(rng: random.Random) -> dict:
    messages = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": rng.choice(SYSTEMS)})
    for _ in range(rng.choice((1, 1, 2, 3))):
        question, answer = _exchange(rng)
        messages += [
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer},
        ]
    return {"messages": messages}


def write(path: Path, n: int, seed: int) -> None:
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            f.write(json.dumps(conversation(rng)) + "\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", default="tests/assets/chat", help="folder for the two files")
    p.add_argument("--train", type=int, default=400, help="conversations in train.jsonl")
    p.add_argument("--validation", type=int, default=40, help="conversations in validation.jsonl")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    out = Path(args.output)
    write(out / "train.jsonl", args.train, args.seed)
    write(out / "validation.jsonl", args.validation, args.seed + 1)
    print(f"wrote {args.train} + {args.validation} conversations to {out}")


if __name__ == "__main__":
    main()
