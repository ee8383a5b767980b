"""Profiler traces on a schedule, CUDA memory snapshots, and the observability config checks."""

from __future__ import annotations

import dataclasses
import json
import pickle
from pathlib import Path

import pytest
import torch

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import Profiling as ProfilingConfig
from torchtitan.config.manager import parse_args
from torchtitan.preflight.validate import validate_config
from torchtitan.tools.profiling import Profiling

ROOT = Path(__file__).resolve().parents[2]
DEBUG_TOML = str(ROOT / "train_configs" / "debug_model.toml")


def _profiling(
    tmp_path: Path, rank: int, device_type: str, schedule: tuple[int, int, int], **fields: object
) -> Profiling:
    """``Profiling`` over ``tmp_path``, ``schedule`` = (profile_freq, profiler_warmup, profiler_active)."""
    freq, warmup, active = schedule
    settings = dataclasses.replace(
        ProfilingConfig(),
        profile_freq=freq,
        profiler_warmup=warmup,
        profiler_active=active,
        save_traces_folder="traces",
        save_memory_snapshot_folder="snapshots",
        **fields,  # type: ignore[arg-type]
    )
    return Profiling(str(tmp_path), settings, rank, device_type)


def _steps_in(trace: Path) -> set[str]:
    events = json.loads(trace.read_text())["traceEvents"]
    return {str(e["name"]) for e in events if str(e.get("name", "")).startswith("my_step_")}


def _run(tmp_path: Path, first: int, last: int) -> Profiling:
    prof = _profiling(tmp_path, 3, "cpu", (4, 1, 2), enable_profiling=True)
    x = torch.randn(32, 32)
    prof.start(first - 1)
    for step in range(first, last + 1):
        with torch.profiler.record_function(f"my_step_{step}"):
            x = torch.tanh(x @ x)
        prof.step(step)
    prof.stop()
    return prof


def test_cpu_traces_every_profile_freq_steps(tmp_path: Path) -> None:
    prof = _run(tmp_path, 1, 9)
    assert prof.trace is not None
    traces = sorted(p.relative_to(tmp_path).as_posix() for p in prof.trace.traces)
    assert traces == ["traces/iteration_4/rank3_trace.json", "traces/iteration_8/rank3_trace.json"]
    # active=2: the two steps ending on the multiple of profile_freq, nothing else.
    assert _steps_in(tmp_path / traces[0]) == {"my_step_3", "my_step_4"}
    assert _steps_in(tmp_path / traces[1]) == {"my_step_7", "my_step_8"}


def test_resumed_run_keeps_the_multiples(tmp_path: Path) -> None:
    prof = _run(tmp_path, 11, 16)  # resumed after step 10
    assert prof.trace is not None
    assert [p.parent.name for p in prof.trace.traces] == ["iteration_12", "iteration_16"]
    assert _steps_in(prof.trace.traces[0]) == {"my_step_11", "my_step_12"}


def test_disabled_profiling_does_nothing(tmp_path: Path) -> None:
    prof = _profiling(tmp_path, 0, "cpu", (4, 1, 1))
    prof.start(0)
    prof.step(1)
    prof.stop()
    assert not list(tmp_path.iterdir())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_memory_snapshots(tmp_path: Path) -> None:
    prof = _profiling(tmp_path, 0, "cuda", (2, 0, 1), enable_memory_snapshot=True)
    prof.start(0)
    kept = []
    for step in range(1, 5):
        kept.append(torch.ones(1 << 20, device="cuda"))
        prof.step(step)
    prof.stop()
    assert prof.memory is not None
    names = [p.parent.name for p in prof.memory.snapshots]
    assert names == ["iteration_2", "iteration_4"]
    snapshot = pickle.loads(prof.memory.snapshots[-1].read_bytes())
    assert snapshot["segments"] and snapshot["device_traces"]


@pytest.mark.parametrize(
    "argv, field",
    [
        (
            ["--profiling.enable_profiling", "--profiling.profile_freq", "3"],
            "profiling.profile_freq",
        ),
        (["--validation.enable", "--validation.steps", "0"], "validation.steps"),
        (["--validation.enable", "--validation.freq", "0"], "validation.freq"),
        (["--metrics.memory_leak_window", "5"], "metrics.memory_leak_window"),
        (["--metrics.memory_leak_min_growth_mib", "0"], "metrics.memory_leak_min_growth_mib"),
        (
            [
                "--validation.enable",
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--parallelism.pipeline_parallel_schedule",
                "ZBVZeroBubble",
            ],
            "validation.enable",
        ),
    ],
)
def test_observability_config_errors(argv: list[str], field: str) -> None:
    cfg = parse_args(["--job.config_file", DEBUG_TOML, *argv])
    with pytest.raises(ConfigError) as e:
        validate_config(cfg, world_size=2)
    assert e.value.field == field, e.value


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only message")
def test_memory_snapshot_needs_cuda() -> None:
    cfg = parse_args(["--job.config_file", DEBUG_TOML, "--profiling.enable_memory_snapshot"])
    with pytest.raises(ConfigError) as e:
        validate_config(cfg, world_size=1)
    assert e.value.field == "profiling.enable_memory_snapshot"
    assert "need a CUDA device" in str(e.value) and "enable_profiling" in str(e.value)


def test_observability_options_validate() -> None:
    cfg = parse_args(
        [
            "--job.config_file",
            DEBUG_TOML,
            "--profiling.enable_profiling",
            "--profiling.profile_freq",
            "10",
            "--validation.enable",
            "--validation.freq",
            "5",
            "--training.nonfinite_policy",
            "skip_step",
        ],
    )
    validate_config(cfg, world_size=2)
