"""Each memory lever's saving matches the estimator's within 10% (docs/planning.md, the table
made by ``benchmarks/memory_levers.py``): the lever's steady-state peak of live tensor memory is
measured with ``LiveTensorTracker`` against the same run without it, on the same ranks, and the
difference is compared with the estimator's. CPU offload's peak is the device peak: the tracker's
log replayed without the storages CPUOffloadPolicy keeps on the host (the benchmark's doc)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from tests.launcher import run_ranks
from tests.script_loader import load
from torchtitan.config.manager import parse_args
from torchtitan.models.llama3.args import LLAMA3_FLAVORS
from torchtitan.planner.estimator import estimate_memory

ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = 0.10


def _bench() -> ModuleType:
    return load("benchmarks/memory_levers.py", "memory_levers_bench")


BENCH = _bench()
_BASES: dict[tuple[str, int], int] = {}


@pytest.fixture
def flavors() -> Iterator[None]:
    before = dict(LLAMA3_FLAVORS)
    BENCH.register_flavors()
    try:
        yield
    finally:
        LLAMA3_FLAVORS.clear()
        LLAMA3_FLAVORS.update(before)


def _device_peak(argv: list[str], ranks: int) -> int:
    return max(r["device"] for r in run_ranks(BENCH.measure, ranks, argv, 3, timeout=600))


def _saving(model: str, lever: str, tmp_path: Path) -> tuple[float, float]:
    ranks, overrides = BENCH.LEVERS[lever]
    base = [*BENCH.BASE, "--model.flavor", model, "--job.dump_folder", str(tmp_path)]
    if (model, ranks) not in _BASES:
        _BASES[model, ranks] = _device_peak(base, ranks)
    got = _device_peak([*base, *overrides], ranks)
    est_base = estimate_memory(parse_args(base), ranks, device_type="cpu").tensor_peak
    est = estimate_memory(parse_args([*base, *overrides]), ranks, device_type="cpu").tensor_peak
    return _BASES[model, ranks] - got, est_base - est


@pytest.mark.parametrize(
    "model, lever",
    [
        ("debugmodel", "chunked_loss_128"),
        pytest.param("cpu_vocab_heavy", "chunked_loss_128", marks=pytest.mark.slow),
        pytest.param("debugmodel", "bf16_moments", marks=pytest.mark.slow),
        pytest.param("debugmodel", "bf16_master_weights", marks=pytest.mark.slow),
        pytest.param("debugmodel", "offload_1dev", marks=pytest.mark.slow),
        pytest.param("debugmodel", "offload_fsdp2", marks=pytest.mark.slow),
    ],
)
def test_lever_saving_within_10_percent(
    model: str, lever: str, flavors: None, tmp_path: Path
) -> None:
    measured, estimated = _saving(model, lever, tmp_path)
    err = (estimated - measured) / measured
    print(
        f"{model} {lever}: saving measured {measured / 2**20:.2f} MiB, "
        f"estimated {estimated / 2**20:.2f} MiB ({err:+.1%})"
    )
    assert measured > 0
    assert abs(err) <= TOLERANCE, f"{model} {lever}: saving error {err:+.1%}"
