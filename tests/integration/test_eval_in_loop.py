"""lm-eval inside training (docs/evaluation.md): with eval.freq 2 over 4 steps the scores land
in the JSONL and TensorBoard at steps 2 and 4, and the evaluation time is kept out of tokens/s."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from tests.parity import read_jsonl  # noqa: E402


@pytest.mark.slow
def test_eval_every_two_steps_lands_at_the_right_steps(tmp_path: Path) -> None:
    from torchtitan.train import main

    argv = [
        "--job.config_file", "train_configs/debug_model.toml", "--job.dump_folder", str(tmp_path),
        "--training.steps", "4", "--training.seq_len", "64", "--training.local_batch_size", "2",
        "--metrics.log_freq", "1", "--metrics.enable_tensorboard",
        "--eval.freq", "2", "--eval.tasks", "torchtitan_facts_mc", "--eval.limit", "8",
    ]  # fmt: skip
    assert main(argv) == 0
    records = read_jsonl(tmp_path / "metrics" / "rank_0.jsonl")
    evals = [r for r in records if "eval/torchtitan_facts_mc/acc" in r]
    assert [r["step"] for r in evals] == [2, 4]
    assert all(0.0 <= r["eval/torchtitan_facts_mc/acc"] <= 1.0 for r in evals)
    eval_time = evals[0]["eval/time_s"]
    assert eval_time > 0
    tps = {r["step"]: r["tokens_per_s"] for r in records if "tokens_per_s" in r}
    # Step 3's throughput window starts after step 2's evaluation: 128 tokens (2 x 64) in less
    # time than that evaluation took (it would be longer if the evaluation were counted).
    window = 128 / tps[3]
    print(f"eval {eval_time:.2f} s; step 3 window {window:.2f} s")
    assert window < eval_time
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb" / "rank_0"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("eval/torchtitan_facts_mc/acc")] == [2, 4]
