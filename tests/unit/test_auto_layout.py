"""``--parallelism.auto`` (planner/auto.py, docs/planning.md): the planner's top layout applied at
launch, the line that names it and pins it, the error when nothing fits, and the all-gather
check that every rank chose the same layout."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tests.launcher import run_ranks
from torchtitan.config import ConfigError
from torchtitan.config.manager import parse_args
from torchtitan.planner.auto import CPU_GLOO, check_same_layout, choose, load_config
from torchtitan.planner.estimator import model_args_for
from torchtitan.planner.planner import plan

ROOT = Path(__file__).resolve().parents[2]
DEBUG = ["--job.config_file", str(ROOT / "train_configs" / "debug_model.toml")]
SMALL = ["--training.seq_len", "128", "--training.local_batch_size", "4"]
HW = dataclasses.replace(CPU_GLOO, memory_gib=8.0, gpus_per_node=2)


def _layout(cfg: object) -> tuple:
    p, t, ac = cfg.parallelism, cfg.training, cfg.activation_checkpoint  # type: ignore[attr-defined]
    return (
        p.data_parallel_replicate_degree,
        p.data_parallel_shard_degree,
        p.tensor_parallel_degree,
        p.pipeline_parallel_degree,
        p.context_parallel_degree,
        p.pipeline_parallel_schedule if p.pipeline_parallel_degree > 1 else None,
        t.local_batch_size,
        t.global_batch_size,
        ac.mode,
        ac.selective_ac_option if ac.mode == "selective" else None,
    )


def test_choice_is_the_planners_first_and_its_pin_line_reproduces_it() -> None:
    cfg = parse_args([*DEBUG, *SMALL, "--parallelism.auto"])
    chosen, note = choose(cfg, 2, HW)
    results, _, _ = plan(cfg, model_args_for(cfg), 2, HW)
    best, second = results[0].layout, results[1].layout
    assert _layout(chosen) == _layout(best.apply(cfg))
    assert chosen.training.global_batch_size == 8  # 4 sequences x 2 ranks, kept
    assert f"chose {best.describe()}" in note and f"runner-up {second.describe()}" in note
    pin = note.split("pin it with: ", 1)[1].split()
    pinned = parse_args([*DEBUG, *SMALL, "--parallelism.auto", *pin])
    assert not pinned.parallelism.auto and _layout(pinned) == _layout(chosen)
    assert choose(cfg, 2, HW)[1] == note  # deterministic


def test_nothing_fits_is_one_line_naming_the_levers() -> None:
    cfg = parse_args([*DEBUG, "--parallelism.auto"])
    with pytest.raises(ConfigError) as e:
        choose(cfg, 2, dataclasses.replace(HW, memory_gib=0.01))
    text = str(e.value)
    assert "\n" not in text and text.startswith("parallelism.auto = True: none of the")
    assert "fits in 0.0 GiB per device" in text and "training.seq_len" in text


def test_load_config_applies_validates_and_marks_the_sources(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("torchtitan.planner.auto.hardware_facts", lambda world: HW)
    argv = [*DEBUG, *SMALL, "--parallelism.auto", "--parallelism.tensor_parallel_degree", "2"]
    cfg, sources, note = load_config(argv, world_size=2)
    assert note is not None and "parallelism.auto chose" in note
    assert sources["training.global_batch_size"] == "parallelism.auto"
    assert sources["parallelism.auto"] == "command line"
    ref, _, _ = plan(cfg, model_args_for(cfg), 2, HW)
    assert cfg.parallelism.tensor_parallel_degree == ref[0].layout.tp  # the given 2 is replaced
    _, _, none = load_config([*DEBUG, *SMALL], world_size=2)
    assert none is None


def _check(argv: list[str]) -> str:
    import torch.distributed as dist

    from torchtitan.config.manager import parse_args as parse

    dist.init_process_group("gloo")
    rank_argv = [*argv, "--training.steps", str(7 + dist.get_rank())] if "differ" in argv else argv
    try:
        check_same_layout(parse([a for a in rank_argv if a != "differ"]))
        return "same"
    except ConfigError as e:
        return str(e)


def test_ranks_that_chose_differently_stop() -> None:
    same = run_ranks(_check, 2, [*DEBUG])
    assert same == ["same", "same"]
    differ = run_ranks(_check, 2, [*DEBUG, "differ"])
    assert differ[0].startswith("parallelism.auto = True: rank 1 chose another layout than rank 0")
    assert differ[1].startswith("parallelism.auto = True: rank 0 chose another layout than rank 1")


def test_benchmark_spearman_and_layout_matching() -> None:
    """benchmarks/planner_vs_measured.py's statistics: Spearman with tied ranks averaged, and the
    match between --parallelism.auto's config and a measured layout."""
    from tests.script_loader import load

    bench = load("benchmarks/planner_vs_measured.py")
    assert bench.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert bench.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ranks x (1, 2.5, 2.5, 4) against y (1, 2, 3, 4): 4.5 / sqrt(4.5 * 5)
    assert bench.spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(4.5 / (4.5 * 5) ** 0.5)
    cfg = parse_args([*DEBUG, *SMALL, "--parallelism.auto"])
    chosen, _ = choose(cfg, 2, HW)
    auto = (chosen.parallelism, chosen.activation_checkpoint)
    results, _, _ = plan(cfg, model_args_for(cfg), 2, HW)
    assert bench._matches(results[0].layout, auto)
    assert not any(bench._matches(r.layout, auto) for r in results[1:])
