"""training.mode, [dpo] and [grpo] (docs/posttrain.md, "Running"): the shipped configs pass the
preflight; bad input is refused before any process group with one line naming the field (and
the file and line of bad data), exit code 2 through ``python -m torchtitan.train``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from torchtitan.config.errors import ConfigError
from torchtitan.preflight.validate import load_config

ROOT = Path(__file__).resolve().parents[2]
DPO = ["--job.config_file", str(ROOT / "train_configs" / "debug_dpo.toml")]
GRPO = ["--job.config_file", str(ROOT / "train_configs" / "debug_grpo.toml")]


def _refused(argv: list[str], *needles: str, world: int = 1) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(argv, world)
    msg = str(e.value)
    assert "\n" not in msg
    for n in needles:
        assert n in msg, msg
    return msg


def _jsonl(path: Path, *records: dict) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_the_shipped_configs_pass() -> None:
    assert load_config(DPO, 1).training.mode == "dpo"
    cfg = load_config(GRPO, 1)
    assert (cfg.training.mode, cfg.grpo.k, cfg.grpo.rewards) == (
        "grpo",
        4,
        ["exact_match", "format"],
    )


def test_a_section_of_another_mode_is_refused() -> None:
    _refused(["--dpo.beta", "0.2"], "dpo.beta", "applies only to training.mode = 'dpo'", "'lm'")
    _refused([*DPO, "--grpo.k", "8"], "grpo.k", "applies only to training.mode = 'grpo'")
    _refused([*GRPO, "--dpo.loss_type", "ipo"], "dpo.loss_type")
    _refused(
        [*DPO, "--training.dataset_path", "x.jsonl"], "training.dataset_path", "unused by 'dpo'"
    )


def test_grpo_k1_is_refused_with_the_reason() -> None:
    _refused([*GRPO, "--grpo.k", "1"], "grpo.k = 1", "every advantage is 0")


def test_bad_settings_and_layouts_are_refused() -> None:
    _refused([*DPO, "--dpo.beta", "0"], "dpo.beta", "must be > 0")
    _refused([*DPO, "--dpo.label_smoothing", "0.1"], "dpo.label_smoothing", "'robust' or 'simpo'")
    _refused([*DPO, "--dpo.reference", "adapters_off"], "dpo.reference", "lora.enable is off")
    _refused([*DPO, "--training.spike_policy", "warn"], "training.spike_policy")
    _refused([*GRPO, "--grpo.rewards", "nope"], "grpo.rewards", "'package.module:function'")
    _refused([*GRPO, "--grpo.rewards", "no_such_module:f"], "cannot be imported")
    _refused([*GRPO, "--grpo.reward_weights", "1.0"], "grpo.reward_weights", "1 weights for 2")
    _refused([*GRPO, "--grpo.prompts_per_step", "3"], "grpo.prompts_per_step", world=2)
    tp = [
        "--parallelism.tensor_parallel_degree",
        "2",
        "--parallelism.data_parallel_shard_degree",
        "1",
    ]
    _refused([*GRPO, *tp], "parallelism.tensor_parallel_degree", "generation under TP", world=2)


def test_bad_data_is_refused_naming_file_and_line(tmp_path: Path) -> None:
    ok = {"prompt": "What is 1+1?", "chosen": "2", "rejected": "3"}
    empty = _jsonl(tmp_path / "empty.jsonl", ok, dict(ok, rejected="  "))
    _refused(
        [*DPO, "--dpo.dataset_path", empty],
        "dpo.dataset_path",
        "empty.jsonl, line 2",
        "rejected side is empty",
    )
    long = _jsonl(tmp_path / "long.jsonl", dict(ok, prompt="x" * 400))
    _refused([*DPO, "--dpo.dataset_path", long], "long.jsonl, line 1", "no room for a completion")
    prompts = _jsonl(
        tmp_path / "p.jsonl",
        {"prompt": "1+1?", "answer": "2"},
        {"prompt": "y" * 100, "answer": "1"},
    )
    _refused(
        [*GRPO, "--grpo.prompts_path", prompts],
        "grpo.prompts_path",
        "p.jsonl:2",
        "exceeds training.seq_len",
    )
    no_answer = _jsonl(tmp_path / "q.jsonl", {"prompt": "1+1?"})
    _refused([*GRPO, "--grpo.prompts_path", no_answer], "no 'answer'", "exact_match")
    _refused([*GRPO, "--grpo.prompts_path", str(tmp_path / "missing.jsonl")], "does not exist")


def test_the_cli_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from torchtitan.train import main

    assert main([*GRPO, "--grpo.k", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("config error: grpo.k = 1"), err
