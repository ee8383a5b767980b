"""Semi-synchronous replica groups' pure parts (docs/fault_tolerance.md): the preflight's
refusals, ``--job.explain``'s traffic and outer-state lines, and the planner's per-rank memory
with the recovery buffer and DiLoCo's outer state."""

from __future__ import annotations

import pytest

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig
from torchtitan.config.manager import parse_args
from torchtitan.preflight.validate_resilience import validate_fault_tolerance

DEBUG = ["--job.config_file", "train_configs/debug_model.toml"]
FT = ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2"]


def _cfg(*argv: str) -> JobConfig:
    return parse_args([*DEBUG, *argv])


@pytest.mark.parametrize(
    ("argv", "field", "words"),
    [
        ([*FT, "--fault_tolerance.semi_sync", "diloco", "--fault_tolerance.sync_every", "0"],
         "fault_tolerance.sync_every = 0", "must be an integer >= 1"),
        ([*FT, "--fault_tolerance.semi_sync", "diloco", "--fault_tolerance.sync_every", "-3"],
         "fault_tolerance.sync_every = -3", "must be an integer >= 1"),
        (["--fault_tolerance.semi_sync", "local_sgd"],
         "fault_tolerance.semi_sync = 'local_sgd'", "need fault_tolerance.enable"),
        ([*FT, "--fault_tolerance.semi_sync", "local_sgd", "--fault_tolerance.outer_lr", "0.7"],
         "fault_tolerance.outer_lr = 0.7", "only with semi_sync diloco"),
        ([*FT, "--fault_tolerance.outer_momentum", "0.9"],
         "fault_tolerance.outer_momentum = 0.9", "only with semi_sync diloco"),
        ([*FT, "--fault_tolerance.sync_every", "4"],
         "fault_tolerance.sync_every = 4", "only semi_sync local_sgd or diloco"),
        ([*FT, "--fault_tolerance.semi_sync", "diloco", "--fault_tolerance.outer_momentum", "1"],
         "fault_tolerance.outer_momentum = 1.0", "must be in [0, 1)"),
        ([*FT, "--fault_tolerance.semi_sync", "diloco", "--fault_tolerance.outer_lr", "0"],
         "fault_tolerance.outer_lr = 0.0", "finite number > 0"),
    ],
)  # fmt: skip
def test_bad_semi_sync_settings_are_one_line_errors(
    argv: list[str], field: str, words: str
) -> None:
    with pytest.raises(ConfigError) as info:
        validate_fault_tolerance(_cfg(*argv))
    text = str(info.value)
    assert text.startswith(field) and words in text and "Fix:" in text and "\n" not in text


def test_good_semi_sync_settings_pass() -> None:
    validate_fault_tolerance(_cfg(*FT, "--fault_tolerance.semi_sync", "diloco"))
    validate_fault_tolerance(
        _cfg(*FT, "--fault_tolerance.semi_sync", "local_sgd", "--fault_tolerance.sync_every", "8")
    )
    validate_fault_tolerance(_cfg())  # off: nothing to check


def test_explain_names_the_sync_traffic_and_diloco_state() -> None:
    """debugmodel's fp32 shard on 1 rank: DiLoCo every 4 steps sends a quarter of a
    synchronous step's bytes per step on average; its outer state is named with its size."""
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.fault_tolerance.explain import MIB, fault_tolerance_lines

    n = 1_000_000
    shard = n * 4 / MIB
    dims = ParallelDims.from_config(_cfg().parallelism, 1)
    sync = fault_tolerance_lines(_cfg(*FT), dims, n)
    assert f"~{shard:,.1f} MiB sent per step" in sync[1]  # 2 groups: ring 2 x 1/2 x shard
    assert "flattened gradient copy" in sync[2]
    lines = fault_tolerance_lines(
        _cfg(*FT, "--fault_tolerance.semi_sync", "diloco", "--fault_tolerance.sync_every", "4"),
        dims,
        n,
    )
    text = "\n".join(lines)
    assert "every 4 steps each rank all-reduces its" in text and "pseudo-gradient" in text
    assert f"~{shard:,.1f} MiB sent per sync, ~{shard / 4:,.1f} MiB per step" in text
    assert "SGD lr 0.7, Nesterov momentum 0.9" in text
    assert f"last synced weights {shard:,.1f} MiB (host)" in text
    assert f"outer momentum {shard:,.1f} MiB" in text
    # device: the momentum all step + pseudo-gradients and local weights at a sync
    assert f"device {3 * shard:,.1f} MiB ({shard:,.1f} MiB all step)" in text
    # host: the recovery buffer (parameters + two moments) and the last synced weights
    assert f"host {4 * shard:,.1f} MiB" in text


def test_memory_estimate_counts_recovery_buffer_and_diloco_state() -> None:
    """The planner's per-rank estimate: fault tolerance adds the recovery buffer to host
    memory and the all-reduce's gradient copy to the optimizer step; DiLoCo adds its outer
    momentum (all step, device) and its last synced weights (host)."""
    from torchtitan.planner.estimator import estimate_memory

    def est(*argv: str):  # noqa: ANN202
        return estimate_memory(_cfg(*argv), 1, device_type="cpu")

    plain = est()
    ft = est(*FT)
    diloco = est(*FT, "--fault_tolerance.semi_sync", "diloco")
    no_momentum = est(
        *FT, "--fault_tolerance.semi_sync", "diloco", "--fault_tolerance.outer_momentum", "0"
    )
    params, moments = plain.parameters, plain.optimizer_states
    assert params > 0 and moments == 2 * params  # fp32 AdamW
    assert plain.host == 0 and ft.host == params + moments  # the recovery buffer
    assert ft.optimizer_states == moments
    assert diloco.optimizer_states == moments + params  # the outer Nesterov momentum
    assert no_momentum.optimizer_states == moments
    assert diloco.host == 2 * params + moments  # + the last synced weights
    assert ft.total >= plain.total and diloco.total > ft.total
    assert any("DiLoCo" in note for note in diloco.notes)
    # the copies made at the cross-group reduction join the optimizer step's moment
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.planner.estimator import model_args_for
    from torchtitan.planner.rank_memory import RankMemory

    def at_step(*argv: str) -> int:
        cfg = _cfg(*argv)
        dims = ParallelDims.from_config(cfg.parallelism, 1)
        return RankMemory(cfg, model_args_for(cfg), dims, None, 0, "cpu", True).ft_sync

    assert at_step() == 0
    assert at_step(*FT) == params  # the flattened fp32 gradients
    assert at_step(*FT, "--fault_tolerance.semi_sync", "local_sgd") == params
    assert at_step(*FT, "--fault_tolerance.semi_sync", "diloco") == 2 * params
