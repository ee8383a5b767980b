"""Tier 1: config parsing, precedence, errors and the seed command lines."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from torchtitan.config import ConfigError, JobConfig, parse_args, to_toml
from torchtitan.config.manager import iter_fields, load_toml
from torchtitan.preflight.validate import validate_config

ROOT = Path(__file__).resolve().parents[2]
DEBUG_TOML = str(ROOT / "train_configs" / "debug_model.toml")


def parse(*argv: str) -> JobConfig:
    return parse_args(list(argv))


@pytest.mark.smoke
def test_defaults_and_toml_and_cli_precedence(tmp_path: Path) -> None:
    assert parse().training.steps == JobConfig().training.steps
    toml = tmp_path / "c.toml"
    toml.write_text("[training]\nsteps = 7\nseq_len = 64\n[metrics]\nlog_freq = 3\n")
    cfg = parse("--job.config_file", str(toml), "--training.steps", "11")
    assert (cfg.training.steps, cfg.training.seq_len, cfg.metrics.log_freq) == (11, 64, 3)
    cfg = parse("--training.steps=12", "--job.config_file", str(toml))
    assert cfg.training.steps == 12  # the command line wins wherever it appears


def test_bools_lists_nested_and_negation() -> None:
    cfg = parse("--compile.enable", "--quantize.dense.float8.enable", "--metrics.enable_wandb=true")
    assert cfg.compile.enable and cfg.quantize.dense.float8.enable and cfg.metrics.enable_wandb
    cfg = parse(
        "--metrics.enable_jsonl", "false", "--no-compile.enable", "--metrics.no-enable-tensorboard"
    )
    assert (
        not cfg.metrics.enable_jsonl
        and not cfg.compile.enable
        and not cfg.metrics.enable_tensorboard
    )
    cfg = parse("--parallelism.pipeline_parallel_split_points", "layers.2,layers.4")
    assert cfg.parallelism.pipeline_parallel_split_points == ["layers.2", "layers.4"]
    cfg = parse("--quantize.dense.float8.filter_fqns=output,wq")
    assert cfg.quantize.dense.float8.filter_fqns == ["output", "wq"]
    cfg = parse("--parallelism.data_parallel_shard_degree", "-1", "--training.dataset_path", "none")
    assert cfg.parallelism.data_parallel_shard_degree == -1 and cfg.training.dataset_path is None
    assert parse("--optimizer.name", "adamw").optimizer.name == "AdamW"  # case-insensitive choices


@pytest.mark.parametrize(
    "argv",
    [
        "--parallelism.data_parallel_shard_degree 8 --compile.enable --quantize.dense.float8.enable",
        "--parallelism.data_parallel_shard_degree 4 --parallelism.tensor_parallel_degree 2 "
        "--parallelism.enable_async_tensor_parallel --compile.enable",
        "--parallelism.data_parallel_shard_degree 8 --parallelism.tensor_parallel_degree 8 "
        "--parallelism.pipeline_parallel_degree 8 --parallelism.pipeline_parallel_schedule interleave_1f1b "
        "--quantize.dense.float8.enable",
    ],
)
def test_seed_command_lines_parse(argv: str) -> None:
    cfg = parse(*argv.split())
    assert cfg.parallelism.data_parallel_shard_degree in (4, 8)


def test_seed_toml_keys(tmp_path: Path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text(
        "[metrics]\nlog_freq = 1\n[parallelism]\npipeline_parallel_microbatches = 4\n"
        'pipeline_parallel_split_points = ["layers.1", "layers.3"]\n'
    )
    cfg = parse("--job.config_file", str(toml))
    assert cfg.metrics.log_freq == 1
    assert cfg.parallelism.pipeline_parallel_microbatches == 4
    assert cfg.parallelism.pipeline_parallel_split_points == ["layers.1", "layers.3"]


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--trainig.steps", "3"], "valid keys of the top level: job, model, training"),
        (["--training.stesp", "3"], "did you mean 'steps'?"),
        (["--training.steps", "many"], "must be an integer"),
        (["--training.steps"], "needs a value"),
        (["--optimizer.name", "SGD"], "must be one of ['AdamW', 'Adam', 'Muon']"),
        (["--no-training.steps"], "only applies to boolean"),
        (["--quantize.dense"], "is a section"),
        (["positional"], "is not an option"),
    ],
)
def test_cli_errors_name_the_field(argv: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse(*argv)
    assert needle in str(e.value) and "Fix:" in str(e.value)


def test_toml_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[training]\nstepz = 3\n")
    with pytest.raises(ConfigError, match=r"valid keys of \[training\]"):
        parse("--job.config_file", str(bad))
    bad.write_text("[training]\nsteps = 'ten'\n")
    with pytest.raises(ConfigError, match="training.steps = 'ten': must be an integer"):
        parse("--job.config_file", str(bad))
    bad.write_text("training = 3\n")
    with pytest.raises(ConfigError, match="is a section"):
        parse("--job.config_file", str(bad))
    with pytest.raises(ConfigError, match="must be an existing TOML file"):
        parse("--job.config_file", str(tmp_path / "missing.toml"))


def test_to_toml_round_trips(tmp_path: Path) -> None:
    cfg = parse("--job.config_file", DEBUG_TOML, "--quantize.dense.float8.filter_fqns", "a,b")
    out = tmp_path / "resolved.toml"
    out.write_text(to_toml(cfg))
    again = parse("--job.config_file", str(out))
    assert again.job.config_file == str(out)
    again.job.config_file = cfg.job.config_file
    assert again == cfg


def test_every_field_has_a_docstring() -> None:
    missing = [name for name, _, _, doc in iter_fields() if not doc]
    assert not missing, f"fields without a docstring: {missing}"


@pytest.mark.parametrize(
    "argv, world, field",
    [
        (
            ["--parallelism.data_parallel_shard_degree", "3"],
            4,
            "parallelism.data_parallel_shard_degree",
        ),
        (["--training.global_batch_size", "12"], 2, "training.global_batch_size"),
        (["--training.steps", "0"], 1, "training.steps"),
        (["--model.flavor", "9B"], 1, "model.flavor"),
        (["--model.tokenizer_path", "/nonexistent"], 1, "model.tokenizer_path"),
        (["--lr_scheduler.decay_ratio", "1.5"], 1, "lr_scheduler.decay_ratio"),
        (["--checkpoint.interval", "0"], 1, "checkpoint.interval"),
        (["--training.document_positions"], 1, "training.document_positions"),
        (["--model.attn_backend", "flex"], 1, "model.attn_backend"),
        (
            [
                "--model.attn_mask_type",
                "block_causal",
                "--parallelism.context_parallel_degree",
                "2",
                "--parallelism.context_parallel_method",
                "ring",
                "--parallelism.context_parallel_rotate_method",
                "alltoall",
            ],
            2,
            "parallelism.context_parallel_rotate_method",
        ),
        (
            ["--parallelism.context_parallel_load_balancer", "document"],
            1,
            "parallelism.context_parallel_load_balancer",
        ),
    ],
)
def test_validation_errors(argv: list[str], world: int, field: str) -> None:
    cfg = parse("--job.config_file", DEBUG_TOML, *argv)
    with pytest.raises(ConfigError) as e:
        validate_config(cfg, world_size=world)
    assert e.value.field == field


@pytest.mark.smoke
def test_debug_config_validates_for_1_2_4_ranks() -> None:
    cfg = parse("--job.config_file", DEBUG_TOML)
    for world in (1, 2, 4):
        validate_config(cfg, world_size=world)


@pytest.mark.smoke
def test_shipped_configs_load() -> None:
    for toml in sorted((ROOT / "train_configs").glob("*.toml")):
        assert load_toml(toml)
        parse("--job.config_file", str(toml))


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torchtitan.config", *argv], capture_output=True, text=True, cwd=ROOT
    )


@pytest.mark.smoke
def test_config_cli_prints_toml_or_error() -> None:
    ok = _cli("--job.config_file", DEBUG_TOML, "--training.steps", "5")
    assert ok.returncode == 0, ok.stderr
    assert "[training]" in ok.stdout and "steps = 5" in ok.stdout
    bad = _cli(
        "--job.config_file",
        DEBUG_TOML,
        "--parallelism.data_parallel_shard_degree",
        "3",
        "--world_size",
        "8",
    )
    assert bad.returncode == 2
    assert "parallelism.data_parallel_shard_degree = 3" in bad.stderr and "Fix:" in bad.stderr
    assert _cli("--help").returncode == 0


def test_config_docs_are_current() -> None:
    """docs/config.md is the snapshot of every option: a new or changed field must regenerate it."""
    from torchtitan.config.docs import config_markdown

    current = (ROOT / "docs" / "config.md").read_text()
    assert current == config_markdown(), (
        "docs/config.md is out of date: run `python -m torchtitan.config.docs > docs/config.md`"
    )
