"""The usual SFT start: pre-train a few steps, save, then fine-tune from those weights with
train_configs/sft_debug.toml (checkpoint.initial_load_path): the loss falls (docs/sft.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.launcher import run_ranks
from tests.parity import DEBUG_TOML, ROOT, TINY, read_jsonl

SFT_TOML = str(ROOT / "train_configs" / "sft_debug.toml")
SMALL = [a for a in TINY if a not in ("--training.seq_len", "64")]  # SFT keeps its own seq_len


def _train(config: str, argv: list[str], dump: str) -> list[dict]:
    from torchtitan.train import main

    rc = main(["--job.config_file", config, "--job.dump_folder", dump, *argv])
    assert rc == 0, f"train exited {rc}"
    return read_jsonl(Path(dump) / "metrics" / "rank_0.jsonl")


def _losses(config: str, argv: list[str], dump: Path) -> list[float]:
    (records,) = run_ranks(_train, 1, config, argv, str(dump), timeout=600.0)
    return [r["loss"] for r in records]


@pytest.mark.slow
def test_sft_debug_config_from_pretrained_checkpoint(tmp_path: Path) -> None:
    pre = tmp_path / "pretrain"
    _losses(DEBUG_TOML, [*TINY, "--training.steps", "4", "--checkpoint.enable"], pre)
    step4 = pre / "checkpoint" / "step-4"
    assert step4.is_dir()
    sft = [*SMALL, "--training.seq_len", "128", "--training.steps", "10"]
    sft += ["--validation.no-enable", "--checkpoint.interval", "100"]
    tuned = _losses(
        SFT_TOML, [*sft, "--checkpoint.initial_load_path", str(step4)], tmp_path / "sft"
    )
    scratch = _losses(SFT_TOML, [*sft, "--training.steps", "1"], tmp_path / "scratch")
    print("SFT losses from the pre-trained checkpoint:", tuned, "from scratch, step 1:", scratch)
    assert tuned[0] != scratch[0]  # the pre-trained weights were loaded
    assert sum(tuned[-3:]) / 3 < tuned[0] - 1.0, tuned  # and the fine-tuning loss falls
