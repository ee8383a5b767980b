"""The estimator and planner with adapters (docs/lora.md, "Planning"): a frozen base has no
gradients or optimizer state, an NF4 base stores its adapted projections in ~0.52 bytes per
value, and when full fine-tuning of Llama 3 8B fits one 24 GiB device only with CPU offload the
planner also proposes QLoRA, named as what it is (its override line validates); the step-time
terms of adapters; QLoRA under FSDP."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tests.unit.test_planner import _check_override_line, _plan
from torchtitan.config.manager import parse_args
from torchtitan.planner.cost_model import step_time
from torchtitan.planner.estimator import GIB, estimate_memory, model_args_for
from torchtitan.planner.layout import Hardware, Layout
from torchtitan.planner.levers import apply_levers
from torchtitan.planner.lora_memory import DEQUANT_BYTES, lora_counts
from torchtitan.planner.planner import summary

pytestmark = pytest.mark.usefixtures("newest_torch_rules")

ROOT = Path(__file__).resolve().parents[2]
ONE = [
    "--parallelism.data_parallel_shard_degree",
    "1",
    "--activation_checkpoint.mode",
    "full",
    "--training.local_batch_size",
    "1",
    "--training.global_batch_size",
    "1",
]
LORA = ["--lora.enable", "--lora.target_modules", "attention.w*,feed_forward.w*"]


def _estimate(*extra: str):
    cfg = parse_args(
        ["--job.config_file", str(ROOT / "train_configs/llama3_8b.toml"), *ONE, *extra]
    )
    return estimate_memory(cfg, 1)


def test_frozen_base_and_nf4_terms() -> None:
    full, lora, qlora = (
        _estimate(),
        _estimate(*LORA),
        _estimate(*LORA, "--lora.quantize_base", "nf4"),
    )
    for name, e in (("full", full), ("lora", lora), ("qlora", qlora)):
        print(
            f"8B {name}: params {e.parameters / GIB:.2f} GiB, optimizer "
            f"{e.optimizer_states / GIB:.3f} GiB, total {e.total / GIB:.2f} GiB"
        )
    # r = 8 on wq, wo (4096 -> 4096), wk, wv (4096 -> 1024), w1, w3, w2 (4096 <-> 14336)
    adapters = 32 * 8 * (2 * 2 * 4096 + 2 * (4096 + 1024) + 3 * (4096 + 14336))
    assert lora.optimizer_states == adapters * 8  # fp32 Adam moments, adapters only
    assert full.optimizer_states > 300 * lora.optimizer_states  # 7 B vs 21 M elements
    assert lora.parameters == pytest.approx(full.parameters + adapters * 4, rel=1e-6)
    # NF4: the adapted projections (~6.98 B values) at ~0.52 bytes instead of 4
    assert qlora.parameters < lora.parameters * 0.45
    assert qlora.total < lora.total < full.total


def test_8b_on_one_24_gib_device_proposes_qlora() -> None:
    """Full fine-tuning (what the config asks for) keeps the first place where it fits at all,
    here only with CPU offload; QLoRA is named as the on-device choice that trains adapters only.
    """
    cfg = parse_args(["--job.config_file", str(ROOT / "train_configs/llama3_8b.toml")])
    results = _plan("llama3_8b.toml", 1, memory_gib=24)
    assert "cpu_offload" in results[0].layout.levers  # full fine-tuning first, offloaded
    tuned = [r for r in results if "lora" in r.layout.levers]
    assert tuned, "no adapter layout proposed"
    best = tuned[0]
    assert "qlora" in best.layout.levers  # LoRA over an fp32 8B base (~32 GiB) does not fit
    assert best.memory.total <= 0.9 * 24 * GIB
    assert best.step_time_s < results[0].step_time_s / 5
    lines = summary(cfg, results)
    print("\n".join(lines))
    n = results.index(best) + 1
    assert lines == [
        f"full fine-tuning: only with CPU offload, {results[0].step_time_s:.1f} s/step (#1)",
        f"on device: QLoRA r=8, {best.memory.total / GIB:.1f} GiB, {best.step_time_s:.1f} "
        f"s/step (#{n}; trains adapters only, the base frozen)",
    ]
    assert 22 < results[0].step_time_s < 27 and 1.0 < best.step_time_s < 2.5
    _check_override_line("llama3_8b.toml", best, 1)


def test_adapter_step_terms() -> None:
    """The same layout with and without adapters: the frozen base's backward skips its
    weight-gradient matmul (-2 N FLOPs a token, +6 n for the adapters), the optimizer steps the
    adapters alone, and QLoRA adds the dequantization of its NF4 weights per pass."""
    cfg = parse_args(["--job.config_file", str(ROOT / "train_configs/llama3_8b.toml"), *ONE])
    a = model_args_for(cfg, vocab_size=2048)
    hw = Hardware(memory_gib=80)
    base = Layout(1, 1, 1, 1, 1, "full", "2", 1, 1)
    _, full = step_time(cfg, a, base, hw, 1)
    _, lora = step_time(cfg, a, dataclasses.replace(base, levers=("lora",)), hw, 1)
    _, qlora = step_time(cfg, a, dataclasses.replace(base, levers=("lora", "qlora")), hw, 1)
    c = lora_counts("llama3", a, apply_levers(cfg, ("lora",)).lora)
    tokens, peak = 8192, hw.peak_tflops * 1e12 * hw.mfu
    frozen = a.num_params(exclude_embedding=True, active=True)
    saved = tokens * (2 * frozen - 6 * c.adapters) / peak
    print(f"8B, 8192 tokens: compute {full['compute']:.3f} -> {lora['compute']:.3f} s (LoRA)")
    assert lora["compute"] == pytest.approx(full["compute"] - saved, rel=1e-9)
    assert 0.7 < lora["compute"] / full["compute"] < 0.8  # ~(4N + 6n) / 6N plus attention
    assert lora["optimizer"] == pytest.approx(c.adapters * 16 / (hw.optimizer_gbps * 1e9))
    assert full["nf4_dequant"] == lora["nf4_dequant"] == 0.0
    dequant = c.adapted * DEQUANT_BYTES * 3 / (hw.optimizer_gbps * 1e9)  # fwd, bwd, recompute
    assert qlora["nf4_dequant"] == pytest.approx(dequant, rel=1e-9)


def test_qlora_is_proposed_under_fsdp() -> None:
    """QLoRA shards its NF4 base with FSDP (docs/lora.md): two 18 GiB devices get an FSDP 2
    QLoRA layout (no TP, CP or replication; 15.8 GiB a device, one device needs 21.4),
    and its override line validates."""
    results = _plan("llama3_8b.toml", 2, memory_gib=18)
    tuned = [r for r in results if "qlora" in r.layout.levers]
    assert tuned and all(r.layout.tp == r.layout.cp == r.layout.dp_replicate == 1 for r in tuned)
    assert any(r.layout.dp_shard == 2 for r in tuned)
    best = next(r for r in tuned if r.layout.dp_shard == 2)
    _check_override_line("llama3_8b.toml", best, 2)
