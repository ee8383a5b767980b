"""Write the two offline lm-eval tasks shipped in ``tests/assets/eval`` (docs/evaluation.md).

Both ask about the facts of the test corpus's fictional world (``scripts/make_test_dataset.py``:
what each animal says, how many legs it has, halves and small sums in words), in the corpus's
own sentence shapes, so a debug model trained on ``test_corpus`` can beat chance:

* ``torchtitan_facts_mc``: multiple choice, one right answer among four (chance 25%), scored
  by log-likelihood (``acc``, ``acc_norm``);
* ``torchtitan_facts_gen``: the same questions answered by greedy generation up to the first
  ``.`` or newline, scored by exact match (chance about 0).

Each task has a ``test`` split and a small disjoint ``train`` split for few-shot examples. Data
files sit beside the YAMLs and are named relative to them; the YAMLs read them through
``custom_dataset: !function facts_data.load`` (``facts_data.py``, written beside them), which
resolves the names from its own folder, so stock ``lm_eval --include_path tests/assets/eval``
finds them from any working directory (torchtitan makes them absolute itself; see
docs/evaluation.md). Deterministic for a given ``--seed``::

    python scripts/make_eval_tasks.py                     # writes tests/assets/eval
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from make_test_dataset import LEGS, PETS, cap, words

_DATA = """\
dataset_path: json
dataset_name: null
custom_dataset: !function facts_data.load
dataset_kwargs:
  data_files:
    train: facts_train.jsonl
    test: facts_test.jsonl
"""

LOADER = '''"""Written by scripts/make_eval_tasks.py (docs/evaluation.md): the tasks' ``custom_dataset``.

lm-eval calls it with the YAML's ``dataset_kwargs`` (and ``metadata``); the ``data_files``
named relative to the YAML are read from this folder, so stock
``lm_eval --include_path tests/assets/eval`` works from any working directory (absolute
names, as torchtitan passes them, are kept).
"""

from pathlib import Path
from typing import Any


def load(data_files: dict[str, str], **_: Any) -> Any:
    import datasets

    here = Path(__file__).resolve().parent
    files = {split: str(here / name) for split, name in data_files.items()}
    return datasets.load_dataset("json", data_files=files)
'''
"""The module beside the YAMLs that their ``custom_dataset`` names (``facts_data.load``)."""


def task_yaml(task: str, output_type: str, fields: str) -> str:
    """One task's YAML: its name, the shared data files and splits, then its own ``fields``."""
    head = f"# Written by scripts/make_eval_tasks.py; docs/evaluation.md.\ntask: {task}\n"
    splits = f"output_type: {output_type}\ntraining_split: train\ntest_split: test\n"
    return head + _DATA + splits + 'doc_to_text: "{{question}}"\n' + fields + _VERSION


_VERSION = """\
metadata:
  version: 1.0
"""

MC_YAML = task_yaml(
    "torchtitan_facts_mc",
    "multiple_choice",
    """\
doc_to_choice: "{{choices}}"
doc_to_target: "{{label}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
""",
)

GEN_YAML = task_yaml(
    "torchtitan_facts_gen",
    "generate_until",
    """\
doc_to_target: "{{answer}}"
generation_kwargs:
  until: [".", "\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    regexes_to_ignore: ["^\\\\s+"]
""",
)


def questions() -> list[tuple[str, str, list[str]]]:
    """Every (question, answer, pool of wrong answers of the same kind)."""
    sounds = sorted(set(PETS.values()))
    legs = sorted({f"{words(n)} legs" if n else "no legs" for n in LEGS.values()})
    out = [(f"The {a} says", s, [x for x in sounds if x != s]) for a, s in sorted(PETS.items())]
    for animal, n in sorted(LEGS.items()):
        answer = f"{words(n)} legs" if n else "no legs"
        out.append((f"A {animal} has", answer, [x for x in legs if x != answer]))
        if n:  # "Two spiders have sixteen legs."
            pair = f"{words(2 * n)} legs"
            pool = sorted({f"{words(2 * m)} legs" for m in LEGS.values() if m and m != n})
            out.append((f"Two {animal}s have", pair, pool))
    small = [words(n) for n in range(20)]
    for a in range(1, 10):
        out.append((f"Half of {words(2 * a)} is", words(a), [x for x in small if x != words(a)]))
    for a, b in [(2, 3), (4, 5), (1, 6), (3, 3), (5, 2), (6, 7), (8, 1), (4, 4), (9, 2), (7, 5)]:
        total = words(a + b)
        q = f"{cap(words(a))} plus {words(b)} is"
        out.append((q, total, [x for x in small if x != total]))
    return out


def make_docs(seed: int) -> list[dict]:
    rng = random.Random(seed)
    docs = []
    for question, answer, wrong in questions():
        choices = [answer, *rng.sample(wrong, 3)]
        rng.shuffle(choices)
        docs.append(
            {
                "question": question,
                "answer": answer,
                "choices": choices,
                "label": choices.index(answer),
            }
        )
    rng.shuffle(docs)
    return docs


def write(out: Path, seed: int, n_train: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    docs = make_docs(seed)
    for name, part in (("train", docs[:n_train]), ("test", docs[n_train:])):
        with (out / f"facts_{name}.jsonl").open("w") as f:
            f.writelines(json.dumps(d) + "\n" for d in part)
    (out / "torchtitan_facts_mc.yaml").write_text(MC_YAML)
    (out / "torchtitan_facts_gen.yaml").write_text(GEN_YAML)
    (out / "facts_data.py").write_text(LOADER)
    print(f"{out}: {len(docs) - n_train} test and {n_train} train questions, 2 tasks")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out-dir", type=Path, default=Path("tests/assets/eval"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n-train", type=int, default=6, help="questions kept for few-shot examples")
    a = p.parse_args(argv)
    write(a.out_dir, a.seed, a.n_train)


if __name__ == "__main__":
    main()
