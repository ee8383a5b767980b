"""The planner proposes the memory levers when no layout fits (docs/planning.md, planner/levers.py),
and the estimator models each lever's bytes (docs/memory.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from torchtitan.config.manager import parse_args
from torchtitan.planner.estimator import GIB, estimate_memory, loss_working_set, model_args_for
from torchtitan.planner.planner import Hardware, plan
from torchtitan.preflight.validate import validate_config

pytestmark = pytest.mark.usefixtures("newest_torch_rules")

ROOT = Path(__file__).resolve().parents[2]
TOML = str(ROOT / "train_configs" / "llama3_8b.toml")
BASE = ["--job.config_file", TOML, "--training.seq_len", "8192", "--training.local_batch_size", "1"]


def _estimate(*overrides: str, world: int = 2):
    cfg = parse_args([*BASE, *overrides])
    return estimate_memory(cfg, world, model_args=model_args_for(cfg, vocab_size=128256))


def test_estimator_bytes_per_lever() -> None:
    base = _estimate()
    n = base.parameters // 4  # fp32 master weights: the shard's elements
    assert base.optimizer_states == 8 * n
    assert _estimate("--optimizer.moments_dtype", "bfloat16").optimizer_states == 4 * n
    bf16 = _estimate("--optimizer.master_weights_dtype", "bfloat16")
    assert bf16.parameters == 2 * n
    off = _estimate("--parallelism.fsdp_cpu_offload")
    assert off.parameters == off.optimizer_states == 0
    assert off.host >= base.parameters + base.optimizer_states
    # Whole logits: the saved fp32 log-softmax and two fp32 gradients (the bf16 logits gradient
    # comes after they are freed); chunked: nothing saved, and three fp32 tensors of one chunk.
    saved, ws = loss_working_set(8192, 128256, 2, 0)
    assert (saved, ws) == (8192 * 128256 * 4, 8192 * 128256 * 8)
    saved, ws = loss_working_set(8192, 128256, 2, 1024)
    assert (saved, ws) == (0, 1024 * 128256 * 12)
    # With the model width (docs/planning.md): from the second chunk on, the weight gradient
    # summed so far and the whole input gradient; at 128k x 4096 the projection's backward
    # (two fp32 chunk tensors, the chunk's weight and input gradients) is the larger moment.
    saved, ws = loss_working_set(8192, 128256, 2, 1024, 4096, 2)
    summed = 128256 * 4096 * 2 + 8192 * 4096 * 2
    assert ws == 1024 * 128256 * 8 + 128256 * 4096 * 2 + 1024 * 4096 * 2 + summed
    assert _estimate("--training.loss_chunk_size", "1024").total < base.total


def test_planner_proposes_levers_with_offload_slowdown() -> None:
    cfg = parse_args(BASE)
    args = model_args_for(cfg, vocab_size=128256)
    results, _, _ = plan(cfg, args, 2, Hardware(memory_gib=80))
    assert results and not results[0].layout.levers  # fits without levers
    results, _, _ = plan(cfg, args, 2, Hardware(memory_gib=24))
    assert results, "nothing fits even with the levers"
    top = results[0]
    assert top.layout.levers == ("chunked_loss", "bf16_moments", "cpu_offload")
    assert top.memory.total <= 0.9 * 24 * GIB
    assert top.terms["offload_copies"] > 0 and top.terms["offload_optimizer"] > 0
    assert any("CPU offload" in r and "GB/s host-device" in r for r in top.reasons)
    # The override line selects the levers and validates.
    argv = list(BASE)
    for item in top.layout.overrides():
        argv += item.split(" ")
    lever_cfg = parse_args(argv)
    validate_config(lever_cfg, world_size=2)
    assert lever_cfg.parallelism.fsdp_cpu_offload
    assert lever_cfg.optimizer.moments_dtype == "bfloat16"
    assert lever_cfg.training.loss_chunk_size > 0
    slower = plan(cfg, args, 2, Hardware(memory_gib=24, host_device_gbps=5.0))[0][0]
    assert slower.terms["offload_copies"] == pytest.approx(5 * top.terms["offload_copies"])


def test_planner_fits_8b_on_one_80gib_device_with_offload() -> None:
    """The issue's headline: Llama 3 8B, seq 8192, batch 1, one 80 GiB device. fp32 weights,
    gradients and bf16 moments alone are 12 bytes x 8.03 B > 80 GiB, so only offload (FSDP on
    a 1-rank mesh) makes it fit."""
    cfg = parse_args([*BASE, "--training.global_batch_size", "1"])
    args = model_args_for(cfg, vocab_size=128256)
    results, _, _ = plan(cfg, args, 1, Hardware(memory_gib=80))
    assert results, "8B does not fit one 80 GiB device even with the levers"
    top = results[0]
    assert top.layout.levers == ("chunked_loss", "bf16_moments", "cpu_offload")
    assert top.layout.dp_shard == top.layout.tp == top.layout.pp == 1
    assert top.memory.total <= 0.9 * 80 * GIB
    assert top.memory.host > 8e9 * (4 + 4 + 4)  # weights, gradients, bf16 moments
    argv = [*BASE, "--training.global_batch_size", "1"]
    for item in top.layout.overrides():
        argv += item.split(" ")
    validate_config(parse_args(argv), world_size=1)


def test_explain_shows_the_levers() -> None:
    from torchtitan.planner.explain import explain

    argv = ["--job.config_file", str(ROOT / "train_configs" / "debug_model.toml")]
    text = explain(parse_args(argv), 2, device_type="cpu")
    assert "memory levers: none" in text
    on = [
        "--parallelism.fsdp_cpu_offload",
        "--optimizer.moments_dtype=bfloat16",
        "--training.loss_chunk_size=256",
    ]
    text = explain(parse_args([*argv, *on]), 2, device_type="cpu")
    line = next(x for x in text.splitlines() if x.startswith("memory levers:"))
    assert "chunked cross-entropy (256 tokens" in line and "bf16 Adam moments" in line
    assert "FSDP CPU offload (" in line and "in host memory" in line
