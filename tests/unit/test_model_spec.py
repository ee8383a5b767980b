"""The model contract (docs/extending.md): every registered family satisfies it, and the
test-only family is a faithful second example."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import tests.toy_model  # noqa: F401  (registers "toy")
from tests.tiny_args import tiny_deepseek_v3, tiny_qwen3_5
from torchtitan.distributed.pipeline_stages import plan_pipeline
from torchtitan.distributed.tensor_parallel import tp_problem
from torchtitan.models import MODELS
from torchtitan.models.common.hf import StateDictAdapter as HFStateDictAdapter
from torchtitan.models.deepseek_v3.hf import DEEPSEEK_V3_HF
from torchtitan.models.spec import FamilySpec


@pytest.mark.parametrize("name", ["llama3", "toy"])
def test_spec_counts_match_the_built_module(name: str) -> None:
    spec = MODELS[name]
    flavor = "debugmodel" if name == "llama3" else "tiny"
    args = spec.flavors[flavor]
    with torch.device("meta"):
        model = spec.build(args)
    counted = sum(p.numel() for p in model.parameters())
    assert spec.num_params(args) == counted
    assert spec.flops_per_token(args, 128) > 6 * (counted - args.vocab_size * args.dim)


@pytest.mark.parametrize("name", ["llama3", "toy"])
def test_plan_paths_exist_in_the_model(name: str) -> None:
    spec = MODELS[name]
    args = spec.flavors["debugmodel" if name == "llama3" else "tiny"]
    plan = spec.parallel_plan(args)
    with torch.device("meta"):
        model = spec.build(args)
    blocks = plan.blocks_of(model)
    assert len(blocks) == args.n_layers
    for path in plan.tensor_parallel.root:
        model.get_submodule(path)
    for path in plan.tensor_parallel.block:
        blocks["0"].get_submodule(path)
    unit_modules = [m for u in plan.pipeline_units for m in u.modules]
    assert {p.split(".")[0] for p in unit_modules} == {n for n, _ in model.named_children()}
    if plan.context_parallel is not None:
        blocks["0"].get_submodule(plan.context_parallel.attention_core)


def test_pipeline_split_uses_the_model_unit_names() -> None:
    plan = MODELS["toy"].parallel_plan(MODELS["toy"].flavors["tiny"])
    p = plan_pipeline(
        units=plan.unit_names,
        pp_degree=2,
        schedule="1F1B",
        split_points=["blocks.2"],
        layers_per_stage=-1,
        microbatches=-1,
        microbatch_size=-1,
        local_batch_size=4,
    )
    assert p.stage_units == (("embed", "blocks.0", "blocks.1"), ("blocks.2", "blocks.3", "head"))
    assert p.describe() == "stage 0: embed, blocks.0-1 | stage 1: blocks.2-3, head"


def test_tp_rule_names_the_size_that_does_not_divide() -> None:
    divisible = MODELS["toy"].parallel_plan(MODELS["toy"].flavors["tiny"]).tensor_parallel.divisible
    assert tp_problem(divisible, 2, 64) is None
    assert "n_heads=4" in (tp_problem(divisible, 3) or "")
    assert "seq_len=63" in (tp_problem(divisible, 2, 63) or "")


def _meta_state_dict(family: str, args: Any) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        return dict(MODELS[family].build(args).state_dict())


def test_family_specs_are_keyword_built_and_use_their_adapter() -> None:
    """``FamilySpec`` takes keywords only (docs/extending.md, section 4), and the converter a
    family names as ``adapter=`` is the one its spec returns: DeepSeek-V3's exports the MTP
    module as Hugging Face layer ``n_layers`` (the shared adapter has no name for it), Qwen3.5's
    reads the multimodal checkpoints' ``model.language_model.`` names."""
    positional: Any = ("toy", {}, nn.Identity, nn.Identity)
    with pytest.raises(TypeError, match="positional"):
        FamilySpec(*positional)  # type: ignore[call-arg]  # mypy refuses it too

    ds = tiny_deepseek_v3(mtp_depth=1)
    ds_sd = _meta_state_dict("deepseek_v3", ds)
    hf = MODELS["deepseek_v3"].state_dict_adapter(ds).to_hf(ds_sd)  # type: ignore[union-attr]
    mtp_layer = {k for k in hf if k.startswith(f"model.layers.{ds.n_layers}.")}
    assert {f"model.layers.{ds.n_layers}.{n}.weight" for n in ("enorm", "hnorm", "eh_proj")} <= (
        mtp_layer
    )
    with pytest.raises(KeyError, match="mtp.0"):
        HFStateDictAdapter(DEEPSEEK_V3_HF, ds).to_hf(ds_sd)

    qw = tiny_qwen3_5()
    qw_sd = _meta_state_dict("qwen3_5", qw)
    adapter: Any = MODELS["qwen3_5"].state_dict_adapter(qw)
    text = adapter.to_hf(qw_sd)
    wrapped = {k.replace("model.", "model.language_model.", 1): w for k, w in text.items()}
    assert wrapped != text and adapter.from_hf(wrapped).keys() == qw_sd.keys()
