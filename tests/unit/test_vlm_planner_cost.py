"""The vision tower in the planner's ranking (``planner/cost_model.py``;
docs/vlm.md, "Planning"): cp and tp ranks repeat its work, under PP it loads the first stage,
and a ranked layout's stage-0 memory holds it."""

from __future__ import annotations

import dataclasses

import pytest

from tests.unit import test_estimator as dense
from torchtitan.config.manager import parse_args
from torchtitan.distributed.model_plan import ModelParallelPlan
from torchtitan.models import MODELS
from torchtitan.models.common.vision.flops import tower_training_flops
from torchtitan.models.qwen3_5_vl import QWEN35_VL_FLAVORS
from torchtitan.planner.cost_model import step_time
from torchtitan.planner.estimator import estimate_memory, model_args_for
from torchtitan.planner.layout import Hardware, Layout
from torchtitan.planner.planner import enumerate_layouts, plan

VISION = QWEN35_VL_FLAVORS["debugmodel"].vision
VLM = ["--model.name", "qwen3_5_vl", "--training.seq_len", "256"]
IMAGES = ["--training.image_tokens_per_sample", "128"]  # 512 patches per sample
HW = Hardware(memory_gib=80)


def _terms(layout: Layout, *extra: str) -> dict[str, float]:
    cfg = parse_args([*dense.BASE, *VLM, *extra])
    world = layout.dp_shard * layout.dp_replicate * layout.tp * layout.cp * layout.pp
    return step_time(cfg, model_args_for(cfg), layout, HW, world)[1]


def _layout(**degrees: int) -> Layout:
    d = {"dp_replicate": 1, "dp_shard": 1, "tp": 1, "pp": 1, "cp": 1, **degrees}
    return Layout(**d, ac_mode="none", ac_option="op", local_batch_size=8,
                  global_batch_size=8 * d["dp_shard"], microbatches=4 if d["pp"] > 1 else -1)  # fmt: skip


def test_cp_repeats_the_towers_work() -> None:
    """CP 2: each cp rank encodes all 8 samples' images, twice its even share; by hand, the
    tokens per device (8 x 256 / 2) x the tower's FLOPs per token / (peak x mfu)."""
    per_token = tower_training_flops(VISION, 512) / 256
    layout = _layout(cp=2)
    t = _terms(layout, *IMAGES)
    expected = 8 * 256 / 2 * per_token * (2 - 1) / (HW.peak_tflops * 1e12 * HW.mfu)
    assert t["vision_replicated"] == pytest.approx(expected, rel=1e-12) and expected > 0
    assert _terms(layout)["vision_replicated"] == 0.0  # no image tokens: nothing to repeat
    assert _terms(_layout(dp_shard=2), *IMAGES)["vision_replicated"] == 0.0  # FSDP splits it


@pytest.mark.parametrize("tokens", [0, 128, 256])
def test_pp_loads_the_first_stage_with_the_tower(tokens: int) -> None:
    """PP 2 (two of the four blocks per stage, the head on the last): the tower weighs on
    stage 0 as its training FLOPs over one block's (by hand: 3 x (2 x block parameters +
    4 x heads x head_dim x seq_len) per token), and the stage imbalance charges the busier
    stage: at 0 image tokens the head's (0.80 blocks), at 128 nearly level (the tower 0.75),
    at 256 the tower's (2.18 blocks)."""
    from torchtitan.planner.estimator import block_params
    from torchtitan.planner.moe_plan import active_block_params

    a = model_args_for(parse_args([*dense.BASE, *VLM]))
    t = _terms(_layout(pp=2), "--training.image_tokens_per_sample", str(tokens))
    block = 3 * (2 * active_block_params(a, block_params(a)) + 4 * a.n_heads * a.head_dim * 256)
    tower = tower_training_flops(VISION, 4 * tokens) / 256 / block if tokens else 0.0
    assert t["tower_load"] == pytest.approx(tower, rel=1e-9)
    head = a.vocab_size * a.dim / active_block_params(a, block_params(a))
    loads = [2 + tower, 2 + head]
    assert t["imbalance"] == pytest.approx(t["compute"] * (max(loads) / (sum(loads) / 2) - 1))
    assert (tower > head) == (tokens == 256)


def test_planner_never_offers_what_the_model_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    """A family whose plan refuses TP (``ModelParallelPlan.refusals``, as the preflight reads
    them): no enumerated layout has tp > 1; without the refusal some do."""
    cfg = parse_args([*dense.BASE, *VLM, *IMAGES])
    layouts = enumerate_layouts(cfg, model_args_for(cfg), 8, HW)
    assert any(lay.tp > 1 for lay in layouts)  # qwen3_5_vl runs TP (docs/vlm.md)
    spec = MODELS["qwen3_5_vl"]
    plan_of = spec.parallel_plan

    def refusing(a: object) -> ModelParallelPlan:
        refusals = {"tensor_parallel": "refused for this test"}
        return dataclasses.replace(plan_of(a), refusals=refusals)

    monkeypatch.setitem(MODELS, "qwen3_5_vl", dataclasses.replace(spec, plan=refusing))
    layouts = enumerate_layouts(cfg, model_args_for(cfg), 8, HW)
    assert layouts and all(lay.tp == 1 for lay in layouts)
    assert any(lay.pp == 2 for lay in layouts)


def test_a_ranked_pp_layout_holds_the_tower_on_stage_0() -> None:
    """``plan`` on 4 devices: a ranked PP 2 layout's stage 0 memory holds the tower (its
    note, and more activations than the same layout without image tokens); stage 1 none."""
    cfg = parse_args([*dense.BASE, *VLM, *IMAGES])
    results, _, _ = plan(cfg, model_args_for(cfg), 4, HW)
    pp = [r for r in results if r.layout.pp == 2]
    assert pp, [r.layout.describe() for r in results]
    r = pp[0]
    assert r.terms["tower_load"] > 0
    stages = [estimate_memory(r.layout.apply(cfg), 4, pp_rank=k) for k in (0, 1)]
    text = parse_args([*dense.BASE, *VLM])
    plain = [estimate_memory(r.layout.apply(text), 4, pp_rank=k) for k in (0, 1)]
    assert any("vision tower (first stage)" in n for n in stages[0].notes)
    assert stages[0].per_microbatch_activations > plain[0].per_microbatch_activations
    assert stages[1].total == plain[1].total
