"""Expert-parallel config rules: each bad degree fails before any process group, naming the
field, the value, the rule and a fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from torchtitan.config import parse_args
from torchtitan.config.errors import ConfigError
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.preflight.validate import validate_config
from torchtitan.preflight.validate_moe import validate_mtp

DEBUG = str(Path(__file__).resolve().parents[2] / "train_configs" / "debug_model.toml")
MOE = ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe"]


def _check(argv: list[str], world: int) -> None:
    validate_config(parse_args(["--job.config_file", DEBUG, *argv]), world_size=world)


@pytest.mark.parametrize(
    ("argv", "world", "field", "rule"),
    [
        (["--parallelism.expert_parallel_degree", "2"], 2, "expert_parallel_degree", "no experts"),
        (
            [*MOE, "--parallelism.expert_parallel_degree", "3"],
            6,
            "expert_parallel_degree",
            "divide the 8 experts",
        ),
        (
            [*MOE, "--parallelism.expert_parallel_degree", "4"],
            2,
            "expert_parallel_degree",
            "must divide",
        ),
        ([*MOE, "--parallelism.expert_parallel_degree", "0"], 2, "expert_parallel_degree", ">= 1"),
        (
            [
                *MOE,
                "--parallelism.expert_parallel_degree",
                "8",
                "--parallelism.context_parallel_degree",
                "2",
            ],
            4,
            "expert_parallel_degree",
            "data_parallel_shard_degree=2 x context_parallel_degree=2 (= 4), which it must divide",
        ),
        (
            [*MOE, "--parallelism.expert_parallel_degree", "2", "--parallelism.fsdp_cpu_offload"],
            4,
            "fsdp_cpu_offload",
            "offload would be partial",
        ),
    ],
)
def test_bad_expert_parallel(argv: list[str], world: int, field: str, rule: str) -> None:
    with pytest.raises(ConfigError) as err:
        _check(
            [*argv, "--training.local_batch_size", "1", "--training.global_batch_size", str(world)],
            world,
        )
    assert field in str(err.value) and rule in str(err.value), str(err.value)


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["--parallelism.context_parallel_degree", "2"],  # EP over dp_shard x cp
        ["--parallelism.data_parallel_replicate_degree", "2"],  # HSDP
    ],
)
def test_good_expert_parallel(extra: list[str]) -> None:
    _check(
        [
            *MOE,
            "--parallelism.expert_parallel_degree",
            "2",
            "--training.local_batch_size",
            "2",
            *extra,
        ],
        4,
    )


def test_moe_overrides_need_an_moe_flavor() -> None:
    with pytest.raises(ConfigError, match="model.moe_aux_loss_coef.*needs an MoE flavor"):
        _check(["--model.moe_aux_loss_coef", "0.1"], 1)
    with pytest.raises(ConfigError, match="model.moe_bias_update_rate.*>= 0"):
        _check([*MOE, "--model.moe_bias_update_rate", "-0.5"], 1)
    _check([*MOE, "--model.moe_aux_loss_coef", "0", "--model.moe_bias_update_rate", "0.001"], 1)


def test_mtp_runs_under_pp_and_allgather_cp_not_ring() -> None:
    """DeepSeek-V3 debugmodel has one MTP module: PP 2 and CP 2 (allgather) validate; ring
    attention's in-place sharding cannot carry the MTP's shifted tokens (refused, with a fix)."""
    ds = ["--model.name", "deepseek_v3", "--training.local_batch_size", "2"]
    _check([*ds, "--parallelism.pipeline_parallel_degree", "2"], 2)
    _check([*ds, "--parallelism.context_parallel_degree", "2"], 2)
    cfg = parse_args(
        ["--job.config_file", DEBUG, *ds, "--parallelism.context_parallel_degree", "2"]
    )
    cfg.parallelism.context_parallel_method = "ring"  # (CPU refuses ring earlier, in general)
    dims = ParallelDims.from_config(cfg.parallelism, 2)
    with pytest.raises(ConfigError, match="context_parallel_method.*allgather"):
        validate_mtp(cfg, dims)
    cfg.model.mtp_depth = 0
    validate_mtp(cfg, dims)
