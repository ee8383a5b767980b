"""Tier 3: torch.compile, activation checkpointing and float8 through the real trainer.

* compile (1 rank, FSDP 2, with AC, with TP 2) trains like eager within an fp32 tolerance;
* float8 tensorwise / rowwise (emulated on CPU, see docs/float8.md) stays within a float8
  tolerance of fp32 and is not identical to it (the layers really were converted);
* FSDP 2 with float8 all-gather and the scale precompute, and TP 2 + compile with float8,
  train like one float8 process.

Compiled runs share an inductor cache under the system temp folder (``--compile.cache_dir``),
so only the first run on a machine pays the cold compile (~16 s per graph on 2 cores).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from tests.launcher import run_ranks
from tests.parity import TINY, _train, assert_losses_close_but_changed, assert_losses_match, losses

STEPS = 8
SMALL = ["--training.seq_len", "32"]
CACHE = str(Path(tempfile.gettempdir()) / "torchtitan-inductor-cache")
COMPILE = ["--compile.enable", "--compile.cache_dir", CACHE]
FLOAT8 = ["--quantize.dense.float8.enable", "--no-quantize.dense.float8.auto_filter_small_kn"]
# fp32 parity: compile reorders and fuses floating-point ops, nothing else.
FP32_RTOL = 1e-5
# float8 vs fp32: operands rounded to 3 (e4m3) or 2 (e5m2) mantissa bits.
FLOAT8_RTOL = 5e-3


def _run(overrides: list[str], world: int, dump: Path) -> list[float]:
    """Per-step losses of rank 0 (like tests.parity.train_metrics, with a longer timeout: a
    cold compile of a new graph on a busy 2-core machine can take minutes)."""
    argv = [*TINY, "--training.steps", str(STEPS), *SMALL]
    argv += ["--training.local_batch_size", str(8 // world), *overrides]
    results = run_ranks(_train, world, argv, str(dump), timeout=900)
    assert results[0] is not None, "rank 0 wrote no metrics"
    return losses(results[0])


@pytest.fixture(scope="module")
def eager(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    ref = _run([], 1, tmp_path_factory.mktemp("eager"))
    assert ref[-1] < ref[0] - 0.5, f"loss did not fall: {ref[0]:.3f} -> {ref[-1]:.3f}"
    return ref


@pytest.fixture(scope="module")
def float8_1rank(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    return _run(
        [*FLOAT8, "--quantize.dense.float8.recipe_name", "tensorwise"],
        1,
        tmp_path_factory.mktemp("f8"),
    )


def test_compile_matches_eager(eager: list[float], tmp_path: Path) -> None:
    got = _run(COMPILE, 1, tmp_path)
    # Inductor fuses the norms, RoPE and SwiGLU, so the rounding differs a little from eager
    # (1.4e-7 measured); bitwise equal losses would mean nothing was compiled.
    assert_losses_close_but_changed(eager, got, FP32_RTOL, "compile, 1 rank")


@pytest.mark.slow
def test_compile_fsdp2_matches_eager(eager: list[float], tmp_path: Path) -> None:
    got = _run(COMPILE, 2, tmp_path)
    assert_losses_match(eager, got, rtol=FP32_RTOL, label="compile + FSDP 2")


@pytest.mark.slow
def test_compile_with_op_level_ac_matches_eager(eager: list[float], tmp_path: Path) -> None:
    ac = [
        "--activation_checkpoint.mode",
        "selective",
        "--activation_checkpoint.selective_ac_option",
        "op",
    ]
    got = _run([*COMPILE, *ac], 1, tmp_path)
    assert_losses_match(eager, got, rtol=FP32_RTOL, label="compile + op-level AC")


@pytest.mark.slow
def test_compile_tp2_matches_eager_cold_and_warm(eager: list[float], tmp_path: Path) -> None:
    """Per-block compile + compiled loss-parallel loss under TP + SP, run twice: the second run
    loads every graph from the cache. TP ranks trace graphs with rank-specific constants that
    torch's AOTAutograd cache does not tell apart; without per-coordinate cache folders the warm
    run trains with wrong losses (torchtitan/distributed/compile.py)."""
    for attempt in ("first", "warm"):
        got = _run([*COMPILE, "--parallelism.tensor_parallel_degree", "2"], 2, tmp_path / attempt)
        assert_losses_match(eager, got, rtol=FP32_RTOL, label=f"compile + TP 2 ({attempt} run)")
    assert (Path(CACHE) / "tp0_cp0").is_dir() and (Path(CACHE) / "tp1_cp0").is_dir()


@pytest.mark.slow
@pytest.mark.parametrize("ac", ["full", "2"])
def test_compile_tp2_with_activation_checkpointing_matches_eager(
    eager: list[float], tmp_path: Path, ac: str
) -> None:
    """TP 2 + compile + AC (full, and every second block): under TP the block inside the
    checkpoint wrapper is compiled and the checkpoint stays eager (compiling the wrapped block
    stopped AOTAutograd with a DeviceMesh among the saved values, torch 2.13;
    docs/parallelisms.md, "Known limits")."""
    mode = ["--activation_checkpoint.mode", "full" if ac == "full" else "selective"]
    mode += [] if ac == "full" else ["--activation_checkpoint.selective_ac_option", ac]
    got = _run([*COMPILE, *mode, "--parallelism.tensor_parallel_degree", "2"], 2, tmp_path)
    assert_losses_match(eager, got, rtol=FP32_RTOL, label=f"compile + TP 2 + AC {ac}")


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_close_to_fp32(
    eager: list[float], float8_1rank: list[float], tmp_path: Path, recipe: str
) -> None:
    got = (
        float8_1rank
        if recipe == "tensorwise"
        else _run([*FLOAT8, "--quantize.dense.float8.recipe_name", recipe], 1, tmp_path)
    )
    # Identical losses would mean no layer was converted.
    why = f"float8 {recipe} losses equal fp32 exactly: were any layers converted?"
    assert_losses_close_but_changed(eager, got, FLOAT8_RTOL, f"float8 {recipe} vs fp32", 1e-6, why)


@pytest.mark.slow
def test_float8_fsdp2_all_gather_precompute(
    eager: list[float], float8_1rank: list[float], tmp_path: Path
) -> None:
    """Tensorwise scales are global amaxes, so sharding does not change the float8 numerics."""
    extra = [
        "--quantize.dense.float8.enable_fsdp_float8_all_gather",
        "--quantize.dense.float8.precompute_float8_dynamic_scale_for_fsdp",
    ]
    got = _run([*FLOAT8, *extra], 2, tmp_path)
    assert_losses_match(float8_1rank, got, rtol=1e-4, label="float8 FSDP 2 vs float8 1 rank")
    assert_losses_match(eager, got, rtol=FLOAT8_RTOL, label="float8 FSDP 2 vs fp32")


@pytest.mark.slow
def test_float8_tp2_compile_matches_float8_eager(float8_1rank: list[float], tmp_path: Path) -> None:
    """Float8 linears sharded by the TP plan (amax all-reduced over the TP group), compiled."""
    got = _run([*FLOAT8, *COMPILE, "--parallelism.tensor_parallel_degree", "2"], 2, tmp_path)
    assert_losses_match(float8_1rank, got, rtol=1e-3, label="float8 + TP 2 + compile vs float8")
