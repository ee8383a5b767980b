"""lm-eval end to end on an ``hf`` family folder (docs/hf_models.md, docs/evaluation.md):
``python -m torchtitan.eval`` run in this process on a tiny transformers Mistral folder with
the shipped offline tasks (tests/assets/eval) writes scores for both tasks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from tests.eval_helpers import HF_TOKENIZER, SEQ_LEN, TASKS, VOCAB  # noqa: E402
from tests.hf_models import save_model  # noqa: E402

LIMIT = 3


def test_eval_entry_point_scores_an_hf_folder(tmp_path: Path) -> None:
    from torchtitan.eval.__main__ import main

    folder = tmp_path / "mistral"
    save_model("mistral", folder, vocab_size=VOCAB)
    argv = [
        *("--model.name", "hf", "--model.flavor", str(folder)),
        *("--model.tokenizer_path", HF_TOKENIZER, "--training.seq_len", str(SEQ_LEN)),
        *("--eval.checkpoint", str(folder), "--eval.tasks", ",".join(TASKS)),
        *("--eval.limit", str(LIMIT), "--eval.max_gen_tokens", "4"),
        *("--job.dump_folder", str(tmp_path / "out")),
    ]
    assert main(argv) == 0
    results = json.loads((tmp_path / "out" / "eval" / "results_step-0.json").read_text())
    for task in TASKS:
        numbers = {
            k: v
            for k, v in results["results"][task].items()
            if "," in k and "stderr" not in k and isinstance(v, (int, float))
        }
        assert numbers, (task, results["results"][task])
        assert all(0.0 <= v <= 1.0 and math.isfinite(v) for v in numbers.values()), numbers
    assert results["n-samples"][TASKS[0]]["effective"] == LIMIT
