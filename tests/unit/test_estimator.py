"""Memory estimator: arithmetic checks, and calibration against the measured peak of live tensor
memory during real training steps (CPU, gloo, forked ranks).

The measurement is ``LiveTensorTracker`` (storages followed from creation to death, FSDP's
in-place storage resizes included), not RSS. Each calibration case prints the estimate next to
the measured peak of every pipeline rank; docs/planning.md lists the errors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch

from tests.distributed.test_memory_lever_savings import BENCH
from tests.launcher import run_ranks
from tests.parity import DEBUG_TOML
from tests.saved_tensors import saved_bytes
from torchtitan.config.job_config import JobConfig
from torchtitan.config.manager import parse_args
from torchtitan.distributed.pipeline_stages import plan_pipeline
from torchtitan.models.llama3.args import LLAMA3_FLAVORS
from torchtitan.planner.estimator import (
    GIB,
    block_activation_bytes,
    estimate_memory,
    in_flight_microbatches,
)
from torchtitan.planner.tracker import LiveTensorTracker
from torchtitan.preflight.validate import load_config

TOLERANCE = 0.10
# A CPU-sized flavor larger than the debug model, with grouped-query attention and an
# ffn_dim_multiplier (registered only for these tests).
CPU_LARGE = BENCH.CPU_LARGE  # dim 512, 8 layers, GQA (benchmarks/memory_levers.py)
BASE = [
    "--job.config_file",
    DEBUG_TOML,
    "--training.seq_len",
    "64",
    "--training.steps",
    "10",
    "--training.mixed_precision_param",
    "float32",
    "--metrics.no-enable_tensorboard",
    "--metrics.no-enable_jsonl",
    "--metrics.no-enable_memory_trace",
    "--comm.init_timeout_seconds",
    "90",
    "--comm.train_timeout_seconds",
    "90",
]


def _cfg(*overrides: str) -> JobConfig:
    return parse_args([*BASE, *overrides])


@pytest.fixture
def cpu_large() -> Iterator[None]:
    LLAMA3_FLAVORS["cpu_large"] = CPU_LARGE
    try:
        yield
    finally:
        del LLAMA3_FLAVORS["cpu_large"]


# ---------------------------------------------------------------------- the tracker
def test_tracker_follows_storages_views_and_resizes() -> None:
    had_attr = "resize_" in torch.UntypedStorage.__dict__
    with LiveTensorTracker() as tracker:
        a = torch.empty(1024)  # 4 KiB
        b = a.view(2, 512)  # a view: the same storage, counted once
        c = a * 2
        assert tracker.current == 8192
        a.untyped_storage().resize_(0)  # how FSDP2 frees gathered parameters
        assert tracker.current == 4096
        a.untyped_storage().resize_(4096)
        del b, c
        assert tracker.current == 4096 and tracker.peak == 8192
        del a
        assert tracker.current == 0
    assert ("resize_" in torch.UntypedStorage.__dict__) == had_attr


def test_tracker_peak_excluding_storages_named_after_the_fact() -> None:
    with LiveTensorTracker(record=True) as tracker:
        host = torch.empty(1024)  # 4 KiB, live all along
        tracker.reset_peak()
        with tracker.collecting() as made:
            moment = torch.empty(2048)  # 8 KiB, made inside the block
        tmp = torch.empty(512)  # 2 KiB transient
        del tmp
        grad = torch.empty(256)  # 1 KiB, named only at the end
        view = moment[:10]
        del moment
        assert tracker.peak == 4096 + 8192 + 2048 + 1024 - 1024  # the temporary came before grad
        excluded = tracker.serials([host, grad]) | made
        assert tracker.serials([view]) <= made  # a view names its base's storage
        # Without host, grad and moment at every moment: only the transient counts.
        assert tracker.peak_excluding(excluded) == 2048
        assert tracker.peak_excluding(set()) == tracker.peak
        del view, host, grad


# ---------------------------------------------------------------------- arithmetic
def saved_block_bytes(model: torch.nn.Module, dim: int, batch: int) -> int:
    """Bytes autograd saves while block 0 of ``model`` runs forward on ``batch`` x 64 tokens."""
    x = torch.randn(batch, 64, dim, requires_grad=True)
    return saved_bytes(model, lambda: model.layers["0"](x, model.freqs_cis[:64]))  # type: ignore[index, operator]


def test_block_activations_match_saved_tensors() -> None:
    """The per-block formula equals what autograd saves for a real block (saved-tensor hooks)."""
    from torchtitan.models.llama3.model import Transformer

    for args in (dataclasses.replace(LLAMA3_FLAVORS["debugmodel"], max_seq_len=64), CPU_LARGE):
        args = dataclasses.replace(args, n_layers=1, max_seq_len=64)
        got = saved_block_bytes(Transformer(args), args.dim, 2)
        expected = block_activation_bytes(args, 2 * 64, 4, tp=1, cp=1, mode="none")
        print(f"dim {args.dim}: saved {got} bytes, formula {expected}")
        assert abs(got - expected) / got < 0.01


def test_sharding_and_ac_shrink_the_estimate() -> None:
    single = estimate_memory(_cfg(), 1, device_type="cpu")
    fsdp = estimate_memory(_cfg(), 4, device_type="cpu")
    full = estimate_memory(_cfg("--activation_checkpoint.mode", "full"), 1, device_type="cpu")
    n = LLAMA3_FLAVORS["debugmodel"].num_params()
    assert single.parameters == 4 * n  # fp32 master weights
    assert single.optimizer_states == 8 * n  # two fp32 AdamW moments
    assert fsdp.parameters == pytest.approx(single.parameters / 4, rel=0.01)
    assert full.activations < single.activations / 4
    first = estimate_memory(_cfg(), 1, device_type="cpu", steady_state=False)
    assert first.optimizer_states == 0


def test_pipeline_in_flight_microbatches() -> None:
    def plan(schedule: str, pp: int, mb: int):  # type: ignore[no-untyped-def]
        return plan_pipeline(
            units=["emb", *(f"layers.{i}" for i in range(16)), "head"],
            pp_degree=pp,
            schedule=schedule,
            split_points=[],
            layers_per_stage=-1,
            microbatches=mb,
            microbatch_size=-1,
            local_batch_size=mb,
        )

    assert [in_flight_microbatches(plan("1F1B", 4, 8), r) for r in range(4)] == [4, 3, 2, 1]
    assert in_flight_microbatches(plan("GPipe", 4, 8), 0) == 8
    assert in_flight_microbatches(plan("1F1B", 4, 2 * 4), 3) == 1
    # Interleaved: (v - 1) * pp + 2 * (pp - 1 - rank) warm-up forwards, plus one.
    assert in_flight_microbatches(plan("Interleaved1F1B", 4, 8), 0) == 11


def test_8b_on_one_80gib_gpu_does_not_fit_but_fsdp8_does() -> None:
    """Llama 3 8B, bf16 compute, seq 8192, local batch 1, selective op AC (the seed's layout)."""
    cfg = _cfg(
        "--model.flavor",
        "8B",
        "--training.seq_len",
        "8192",
        "--training.local_batch_size",
        "1",
        "--training.mixed_precision_param",
        "bfloat16",
        "--activation_checkpoint.mode",
        "selective",
        "--activation_checkpoint.selective_ac_option",
        "op",
    )
    args = dataclasses.replace(LLAMA3_FLAVORS["8B"], max_seq_len=8192)
    one = estimate_memory(cfg, 1, model_args=args)
    eight = estimate_memory(cfg, 8, model_args=args)
    print("8B on 1 GPU:\n" + one.table() + "\n8B FSDP 8:\n" + eight.table())
    assert one.parameters == pytest.approx(4 * args.num_params(), rel=1e-6)
    assert one.total > 80 * GIB  # 16 bytes per parameter alone is 120 GiB
    assert 20 * GIB < eight.total < 60 * GIB


# ---------------------------------------------------------------------- calibration
def _measure(argv: list[str], steps: int) -> int:
    """Peak live tensor memory of this rank over the steady-state steps (after the first)."""
    from torchtitan.training.trainer import Trainer

    trainer = Trainer(load_config(argv))
    held = [p for part in trainer.model_parts for p in [*part.parameters(), *part.buffers()]]
    peaks = []
    with LiveTensorTracker() as tracker:
        tracker.add(held)
        for _ in range(steps):
            tracker.reset_peak()
            trainer.step += 1
            trainer.train_step()
            peaks.append(tracker.peak)
    trainer.close()
    return max(peaks[1:])


CASES = {
    "debug-1rank-ac-none": (1, []),
    "debug-1rank-ac-full": (1, ["--activation_checkpoint.mode", "full"]),
    "large-1rank-ac-op": (
        1,
        [
            "--model.flavor",
            "cpu_large",
            "--activation_checkpoint.mode",
            "selective",
            "--activation_checkpoint.selective_ac_option",
            "op",
        ],
    ),
    "debug-fsdp2-ac-sel2": (
        2,
        [
            "--activation_checkpoint.mode",
            "selective",
            "--activation_checkpoint.selective_ac_option",
            "2",
        ],
    ),
    "debug-fsdp2xtp2": (4, ["--parallelism.tensor_parallel_degree", "2"]),
    "debug-cp2": (2, ["--parallelism.context_parallel_degree", "2"]),
    "large-pp2-interleaved-mb4": (
        2,
        [
            "--model.flavor",
            "cpu_large",
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_schedule",
            "Interleaved1F1B",
            "--parallelism.pipeline_parallel_microbatches",
            "4",
        ],
    ),
    "debug-3d-pp2xfsdp2xtp2-ac-full": (
        8,
        [
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.tensor_parallel_degree",
            "2",
            "--activation_checkpoint.mode",
            "full",
        ],
    ),
}


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.slow) if CASES[n][0] >= 4 else n for n in CASES],
)
def test_estimate_within_10_percent_of_measured_peak(
    name: str, cpu_large: None, tmp_path: object
) -> None:
    world_size, overrides = CASES[name]
    argv = [*BASE, "--job.dump_folder", str(tmp_path), *overrides]
    assert_estimate_matches(name, argv, world_size, run_ranks(_measure, world_size, argv, 2))


def assert_estimate_matches(
    name: str, argv: list[str], world_size: int, measured: list[int]
) -> None:
    """Each pipeline rank's estimate (``tensor_peak``) within ``TOLERANCE`` of the largest peak
    measured on its ranks."""
    cfg = parse_args(argv)
    pp = cfg.parallelism.pipeline_parallel_degree
    per_pp = world_size // pp
    worst = 0.0
    for r in range(pp):
        est = estimate_memory(cfg, world_size, device_type="cpu", pp_rank=r)
        peak = max(measured[r * per_pp : (r + 1) * per_pp])  # pp is the outermost mesh axis
        err = (est.tensor_peak - peak) / peak
        worst = max(worst, abs(err))
        print(
            f"{name} pp rank {r}: estimate {est.tensor_peak / 2**20:.1f} MiB "
            f"({est.phase}), measured {peak / 2**20:.1f} MiB, error {err:+.1%}"
        )
    assert worst <= TOLERANCE, f"{name}: worst error {worst:.1%} > {TOLERANCE:.0%}"
