"""Tier 1: pipeline stage arithmetic (splits, schedules, microbatches), config errors, LOG_RANK words."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from torchtitan.config import ConfigError, JobConfig, parse_args
from torchtitan.distributed.pipeline_parallel import split_model
from torchtitan.distributed.pipeline_stages import (
    SCHEDULES,
    PipelineStages,
    normalize_schedule_name,
    plan_pipeline,
)
from torchtitan.log_ranks import main as log_ranks_main
from torchtitan.log_ranks import resolve_log_ranks
from torchtitan.models.common.decoder_plan import pipeline_units
from torchtitan.models.llama3 import LLAMA3_FLAVORS, Transformer
from torchtitan.preflight.validate import pipeline_stages, validate_config


def model_units(n_layers: int) -> list[str]:
    args = dataclasses.replace(LLAMA3_FLAVORS["debugmodel"], n_layers=n_layers)
    return [u.name for u in pipeline_units(args)]


# Planning rules as on torch >= 2.13 (V schedules and PP x TP are refused on 2.11).
pytestmark = pytest.mark.usefixtures("newest_torch_rules")

ROOT = Path(__file__).resolve().parents[2]
DEBUG_TOML = str(ROOT / "train_configs" / "debug_model.toml")


def plan(
    pp: int = 2,
    schedule: str = "1F1B",
    split_points: tuple[str, ...] = (),
    layers_per_stage: int = -1,
    microbatches: int = -1,
    microbatch_size: int = -1,
    local_batch_size: int = 8,
    n_layers: int = 6,
) -> PipelineStages:
    return plan_pipeline(
        units=model_units(n_layers),
        pp_degree=pp,
        schedule=schedule,
        split_points=list(split_points),
        layers_per_stage=layers_per_stage,
        microbatches=microbatches,
        microbatch_size=microbatch_size,
        local_batch_size=local_batch_size,
    )


def config(*argv: str) -> JobConfig:
    return parse_args(["--job.config_file", DEBUG_TOML, *argv])


@pytest.mark.parametrize(
    "spelling, name",
    [
        ("1F1B", "1F1B"),
        ("1f1b", "1F1B"),
        ("GPipe", "GPipe"),
        ("gpipe", "GPipe"),
        ("Interleaved1F1B", "Interleaved1F1B"),
        ("interleave_1f1b", "Interleaved1F1B"),
        ("interleaved-1f1b", "Interleaved1F1B"),
        ("looped_bfs", "LoopedBFS"),
        ("InterleavedZeroBubble", "InterleavedZeroBubble"),
        ("ZBVZeroBubble", "ZBVZeroBubble"),
        ("zbv", "ZBVZeroBubble"),
        ("DualPipeV", "DualPipeV"),
        ("dual_pipe_v", "DualPipeV"),
    ],
)
def test_schedule_spellings(spelling: str, name: str) -> None:
    assert normalize_schedule_name(spelling) == name


def test_every_torch_schedule_is_offered() -> None:
    from torch.distributed.pipelining.schedules import get_schedule_class

    for name in SCHEDULES:
        assert get_schedule_class(name).__name__.endswith(name)
    with pytest.raises(ConfigError, match="pipeline_parallel_schedule.*not a pipeline schedule"):
        normalize_schedule_name("1F2B")


def test_even_splits_put_embedding_first_and_head_last() -> None:
    assert model_units(2) == ["tok_embeddings", "layers.0", "layers.1", "norm"]
    p = plan(pp=2, schedule="1F1B")
    assert p.stage_units == (
        ("tok_embeddings", "layers.0", "layers.1", "layers.2"),
        ("layers.3", "layers.4", "layers.5", "norm"),
    )
    assert (p.n_microbatches, p.stage_ids(0), p.stage_ids(1), p.last_stage_pp_rank) == (
        2,
        [0],
        [1],
        1,
    )
    # Multi-stage schedules default to two stages per rank, placed round-robin.
    p = plan(pp=2, schedule="interleave_1f1b")
    assert [len(u) for u in p.stage_units] == [2, 2, 2, 2]
    assert (p.stage_ids(0), p.stage_ids(1), p.last_stage_pp_rank) == ([0, 2], [1, 3], 1)
    assert p.describe() == (
        "stage 0: tok_embeddings, layers.0 | stage 1: layers.1-2 | stage 2: layers.3-4 | "
        "stage 3: layers.5, norm"
    )
    # 10 units over 4 stages: the first stages take the extra unit.
    assert [len(u) for u in plan(pp=4, n_layers=8).stage_units] == [3, 3, 2, 2]


def test_v_shaped_schedules_put_the_last_stage_on_pp_rank_0() -> None:
    p = plan(pp=4, schedule="ZBVZeroBubble")
    assert p.num_stages == 8 and all(len(u) == 1 for u in p.stage_units)
    assert [p.stage_ids(r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert p.last_stage_pp_rank == 0
    assert p.last_stage_global_ranks(16) == [0, 1, 2, 3]
    assert plan(pp=4, schedule="1F1B").last_stage_global_ranks(16) == [12, 13, 14, 15]


def test_split_points_and_layers_per_stage() -> None:
    p = plan(pp=2, split_points=("layers.4",))
    assert p.stage_units[0] == ("tok_embeddings", "layers.0", "layers.1", "layers.2", "layers.3")
    assert p.stage_units[1] == ("layers.4", "layers.5", "norm")
    # 'norm' gives the head a stage of its own; 'layers.0' leaves the embedding alone.
    p = plan(pp=2, schedule="Interleaved1F1B", split_points=("layers.0", "layers.3", "norm"))
    assert p.stage_units == (
        ("tok_embeddings",),
        ("layers.0", "layers.1", "layers.2"),
        ("layers.3", "layers.4", "layers.5"),
        ("norm",),
    )
    p = plan(pp=2, schedule="LoopedBFS", layers_per_stage=2)
    assert [len(u) for u in p.stage_units] == [2, 2, 2, 2]
    assert plan(pp=2, schedule="Interleaved1F1B", layers_per_stage=4).num_stages == 2


@pytest.mark.parametrize(
    "kwargs, field, words",
    [
        (dict(split_points=("layers.6",)), "split_points", "not a split point"),
        (dict(split_points=("layer.3",)), "split_points", "not a split point"),
        (dict(split_points=("tok_embeddings",)), "split_points", "would be empty"),
        (
            dict(schedule="Interleaved1F1B", split_points=("layers.2", "layers.2", "layers.4")),
            "split_points",
            "would be empty",
        ),
        (
            dict(schedule="Interleaved1F1B", split_points=("layers.4", "layers.2", "layers.5")),
            "split_points",
            "would be empty",
        ),
        (dict(pp=8, schedule="Interleaved1F1B"), "degree", "only 8 layers"),
        (dict(pp=4, schedule="zbv", n_layers=2), "degree", "asks for 8 stages"),
        (dict(split_points=("layers.2", "layers.4")), "split_points", "exactly one stage"),
        (dict(schedule="GPipe", layers_per_stage=2), "layers_per_stage", "exactly one stage"),
        (
            dict(schedule="ZBVZeroBubble", split_points=("layers.3",)),
            "split_points",
            "exactly two stages",
        ),
        (
            dict(pp=4, schedule="LoopedBFS", split_points=("layers.3",)),
            "split_points",
            "multiple",
        ),
        (dict(split_points=("layers.3",), layers_per_stage=2), "layers_per_stage", "combined"),
        (dict(layers_per_stage=0), "layers_per_stage", ">= 1"),
        (dict(microbatches=1), "microbatches", "fewer microbatches than pipeline stages"),
        (dict(schedule="zbv", microbatches=2), "microbatches", "fewer microbatches"),
        (dict(microbatches=3), "microbatches", "must divide"),
        (dict(microbatches=0), "microbatches", ">= 1"),
        (dict(microbatch_size=3), "microbatch_size", "must divide"),
        (dict(microbatches=2, microbatch_size=2), "microbatches", "disagrees"),
        (dict(pp=4, schedule="1F1B", local_batch_size=2), "microbatches", "must divide"),
        (
            dict(pp=2, schedule="Interleaved1F1B", microbatches=5, local_batch_size=10),
            "microbatches",
            "multiple of max",
        ),
    ],
)
def test_invalid_pipelines_are_config_errors(kwargs: dict, field: str, words: str) -> None:
    with pytest.raises(ConfigError) as err:
        plan(**kwargs)
    assert err.value.field == "parallelism.pipeline_parallel_" + field
    assert words in str(err.value) and "Fix:" in str(err.value)


def test_microbatch_size() -> None:
    assert plan(microbatch_size=2).n_microbatches == 4
    assert plan(microbatch_size=2, microbatches=4).n_microbatches == 4
    assert plan(schedule="Interleaved1F1B", microbatches=8).n_microbatches == 8


def test_validate_config_runs_the_pipeline_checks() -> None:
    cfg = config(
        "--parallelism.data_parallel_shard_degree",
        "2",
        "--parallelism.tensor_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_schedule",
        "interleave_1f1b",
    )
    validate_config(cfg, world_size=8)
    p = pipeline_stages(cfg)
    assert p is not None and (p.schedule, p.num_stages, p.n_microbatches) == (
        "Interleaved1F1B",
        4,
        4,
    )
    assert pipeline_stages(config()) is None
    with pytest.raises(ConfigError, match="pipeline_parallel_schedule"):
        validate_config(config("--parallelism.pipeline_parallel_schedule", "nope"), world_size=1)
    with pytest.raises(ConfigError, match="microbatches"):
        validate_config(
            config(
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--parallelism.pipeline_parallel_microbatches",
                "1",
            ),
            world_size=2,
        )


@pytest.mark.parametrize("schedule", ["InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"])
def test_compile_with_a_schedule_that_refuses_compiled_stages(schedule: str) -> None:
    argv = ["--parallelism.pipeline_parallel_degree", "2", "--compile.enable"]
    with pytest.raises(ConfigError) as err:
        validate_config(
            config(*argv, "--parallelism.pipeline_parallel_schedule", schedule), world_size=2
        )
    assert err.value.field == "parallelism.pipeline_parallel_schedule"
    assert "refuses compiled stages" in str(err.value)
    cfg = config(*argv, "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B")
    validate_config(cfg, world_size=2)


def test_tied_embeddings_are_refused() -> None:
    with pytest.raises(ConfigError, match="ties the embedding"):
        pipeline_stages(
            config("--model.flavor", "1B", "--parallelism.pipeline_parallel_degree", "2")
        )


def test_split_model_keeps_full_model_names() -> None:
    args = dataclasses.replace(
        LLAMA3_FLAVORS["debugmodel"], dim=64, n_heads=4, vocab_size=128, max_seq_len=64
    )
    with torch.device("meta"):
        model = Transformer(args)
    p = plan(pp=2, schedule="Interleaved1F1B", split_points=("layers.0", "layers.3", "norm"))
    units = pipeline_units(args)
    parts = [split_model(model, units, keep) for keep in p.stage_units]
    names = [set(dict(part.named_parameters())) for part in parts]
    assert names[0] == {"tok_embeddings.weight"}
    assert names[3] == {"norm.weight", "output.weight"}
    assert all(n.startswith("layers.") for n in names[1] | names[2])
    assert {n.split(".")[1] for n in names[2]} == {"3", "4", "5"}
    assert set().union(*names) == set(dict(model.named_parameters()))
    assert sum(len(n) for n in names) == len(list(model.parameters()))
    assert len(model.layers) == 6  # the original is untouched
    # A middle stage maps hidden states to hidden states.
    part = parts[1]
    part.to_empty(device="cpu")
    part.init_weights(seed=0)  # type: ignore[operator]
    h = torch.randn(2, 16, args.dim)
    assert part(h).shape == h.shape


def test_log_rank_words() -> None:
    p = plan(pp=2, schedule="1F1B")
    assert resolve_log_ranks("0,last", 8, p) == [0, 4, 5, 6, 7]
    assert resolve_log_ranks("last", 8, plan(pp=2, schedule="DualPipeV")) == [0, 1, 2, 3]
    assert resolve_log_ranks("all", 2, p) == [0, 1]
    assert resolve_log_ranks("1, 0", 2, None) == [0, 1]
    assert resolve_log_ranks("last", 2, None) == [0, 1]  # without PP every rank has the loss
    with pytest.raises(ValueError, match="not a rank below 2"):
        resolve_log_ranks("2", 2, p)


def test_log_rank_helper_reads_the_config(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--job.config_file", DEBUG_TOML, "--parallelism.pipeline_parallel_degree", "2"]
    assert (
        log_ranks_main(["0,last", "4", *argv, "--parallelism.pipeline_parallel_schedule", "gpipe"])
        == 0
    )
    assert capsys.readouterr().out.strip() == "0,2,3"
    assert (
        log_ranks_main(["last", "4", *argv, "--parallelism.pipeline_parallel_schedule", "zbv"]) == 0
    )
    assert capsys.readouterr().out.strip() == "0,1"
    assert log_ranks_main(["last,x", "4", *argv]) == 2
