"""The planner and Mixture-of-Experts models (``planner/moe_plan.py``, docs/planning.md "MoE"):
expert-parallel degrees come from the validator, the all-to-all term is the explain's volume
over the right bandwidth, Qwen3-30B-A3B gets an EP layout, dense models never do."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.test_planner import _plan as plan_for
from torchtitan.config.manager import parse_args
from torchtitan.planner.estimator import GIB, model_args_for
from torchtitan.planner.moe_memory import all_to_all_bytes
from torchtitan.planner.moe_plan import ep_choices
from torchtitan.planner.planner import Hardware, Layout, PlanResult, step_time
from torchtitan.preflight.validate import validate_config

pytestmark = pytest.mark.usefixtures("newest_torch_rules")

ROOT = Path(__file__).resolve().parents[2]
MOE = "qwen3_30b_a3b.toml"
MOE_TOML = str(ROOT / "train_configs" / MOE)
QWEN3_VOCAB = 151936


def _plan(name: str, world_size: int) -> list[PlanResult]:
    return plan_for(name, world_size, vocab=QWEN3_VOCAB)


def _validates(toml: str, r: PlanResult, world_size: int) -> None:
    argv = ["--job.config_file", toml]
    for item in r.layout.overrides():
        argv += item.split(" ")
    cfg = parse_args(argv)
    validate_config(cfg, world_size=world_size)
    assert cfg.parallelism.expert_parallel_degree == r.layout.ep


def test_ep_choices_are_the_validators() -> None:
    cfg = parse_args(["--job.config_file", MOE_TOML, "--model.flavor", "debugmodel_moe"])
    assert ep_choices(cfg, 16, 1, 16, 1, 1, 1) == [1, 2, 4, 8]  # 8 experts
    assert ep_choices(cfg, 12, 1, 12, 1, 1, 1) == [1, 2, 4]
    assert ep_choices(cfg, 32, 2, 16, 1, 1, 1) == [1, 2, 4, 8]  # with HSDP: within a replica
    assert ep_choices(cfg, 2, 1, 1, 2, 1, 1) == [1, 2]  # EP borrows from dp_shard x cp
    assert ep_choices(cfg, 12, 1, 3, 4, 1, 1) == [1, 2, 4]  # divides 3 x 4 and the 8 experts
    dense = parse_args(["--job.config_file", str(ROOT / "train_configs" / "qwen3_8b.toml")])
    assert ep_choices(dense, 16, 1, 16, 1, 1, 1) == [1]


def test_all_to_all_term() -> None:
    """EP 8 in a node, AC none: 4 all-to-alls (dispatch + combine, fwd + bwd) per MoE layer of
    the explain's volume, at 450 GB/s, plus 7 latencies each."""
    cfg = parse_args(["--job.config_file", MOE_TOML])
    a = model_args_for(cfg, vocab_size=QWEN3_VOCAB)
    hw = Hardware(memory_gib=80)
    lay = Layout(1, 8, 1, 1, 1, "none", "2", 1, 8, ep=8)
    _, terms = step_time(cfg, a, lay, hw, 8)
    one = all_to_all_bytes(a, 4096, 2, 8)
    assert one == 4096 * 8 * 2048 * 2 * 7 / 8
    assert terms["all_to_all"] == pytest.approx(48 * 4 * (one / 450e9 + 7 * 10e-6))
    assert terms["moe_tp"] == 0.0
    no_ep = step_time(cfg, a, Layout(1, 8, 1, 1, 1, "none", "2", 1, 8), hw, 8)[1]
    assert no_ep["all_to_all"] == 0.0
    # FSDP traffic: EP 8 x efsdp 1 gathers no experts at all.
    assert terms["fsdp_total"] < no_ep["fsdp_total"] / 5


def test_30b_a3b_at_its_published_size_plans_expert_parallel() -> None:
    """16 devices (two nodes of 8, the config's own world size), 80 GiB."""
    results = _plan(MOE, 16)
    top = results[0]
    assert top.layout.ep > 1, top.layout.describe()
    assert f"(EP {top.layout.ep})" in top.layout.describe()
    assert top.memory.total <= 0.9 * 80 * GIB
    assert top.terms["all_to_all"] > 0
    _validates(MOE_TOML, top, 16)


def test_30b_a3b_on_64_devices_ranks_an_ep_layout() -> None:
    results = _plan(MOE, 64)
    ep = [r for r in results[:3] if r.layout.ep > 1]
    assert ep, "an expert-parallel layout among the top three"
    _validates(MOE_TOML, ep[0], 64)


def test_a_dense_model_never_gets_ep() -> None:
    results = _plan("qwen3_8b.toml", 8)
    assert results and all(r.layout.ep == 1 for r in results)
    assert "expert_parallel" not in " ".join(results[0].layout.overrides())


def test_moe_recompute_and_tp_terms() -> None:
    """Op-level AC recomputes wk, wo and the routed experts of an MoE block; TP repeats the
    expert FLOPs on every TP rank."""
    from torchtitan.planner.moe_plan import moe_op_recompute_fraction

    cfg = parse_args(["--job.config_file", MOE_TOML])
    a = model_args_for(cfg, vocab_size=QWEN3_VOCAB)
    routed = 8 * 3 * 2048 * 768
    recomputed = 2048 * 512 + 4096 * 2048 + routed
    total = 2 * 2048 * 4096 + 2 * 2048 * 512 + 128 * 2048 + routed
    assert moe_op_recompute_fraction(a) == pytest.approx(recomputed / total)
    hw = Hardware(memory_gib=80)
    _, terms = step_time(cfg, a, Layout(1, 4, 2, 1, 1, "none", "2", 1, 4), hw, 8)
    # A TP group's 4096 tokens x 48 layers x 6 x routed FLOPs, half of it extra per TP rank.
    peak = hw.peak_tflops * 1e12 * hw.mfu
    assert terms["moe_tp"] == pytest.approx(4096 * 48 * 6 * routed / 2 / peak)
