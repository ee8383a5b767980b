"""The estimator and planner with adapters (docs/lora.md, "Planning"): a frozen base has no
gradients or optimizer state, an NF4 base stores its adapted projections in ~0.52 bytes per
value, and when full fine-tuning of Llama 3 8B fits one 24 GiB device only with CPU offload the
planner also proposes QLoRA (its override line validates)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.test_planner import _check_override_line, _plan
from torchtitan.config.manager import parse_args
from torchtitan.plan.estimator import GIB, estimate_memory

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
    results = _plan("llama3_8b.toml", 1, memory_gib=24)
    assert "cpu_offload" in results[0].layout.levers  # full fine-tuning first, offloaded
    tuned = [r for r in results if "lora" in r.layout.levers]
    assert tuned, "no adapter layout proposed"
    best = tuned[0]
    assert "qlora" in best.layout.levers  # LoRA over an fp32 8B base (~32 GiB) does not fit
    assert best.memory.total <= 0.9 * 24 * GIB
    assert best.step_time_s < results[0].step_time_s / 5
    _check_override_line("llama3_8b.toml", best, 1)
