"""Qwen3 dense and Qwen3-MoE: published sizes, the ModelSpec contract, and logits equal to
transformers' Qwen3ForCausalLM / Qwen3MoeForCausalLM through the state-dict adapter (fp32,
max abs diff <= 1e-5), in both directions."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from tests import hf_parity
from tests.spec_checks import built_on_meta
from tests.tiny_args import tiny_qwen3
from torchtitan.models import MODELS
from torchtitan.models.common.hf import StateDictAdapter
from torchtitan.models.common.moe import MoEArgs
from torchtitan.models.qwen3 import QWEN3_FLAVORS, Qwen3Args, Transformer
from torchtitan.models.qwen3.hf import QWEN3_HF

DENSE = tiny_qwen3()
# Layer 1 dense (mlp_only_layers), layer 0 and 2 sparse: every mapping is exercised.
MOE = dataclasses.replace(
    DENSE,
    n_layers=3,
    tie_word_embeddings=False,
    moe=MoEArgs(num_experts=8, top_k=2, expert_dim=32),
    moe_layers=(0, 2),
)


@pytest.mark.parametrize(
    ("flavor", "total", "active"),
    [
        ("0.6B", 0.596, 0.596),
        ("8B", 8.19, 8.19),
        ("30B-A3B", 30.53, 3.35),
        ("235B-A22B", 235.1, 22.2),
    ],
)
def test_published_sizes(flavor: str, total: float, active: float) -> None:
    args = QWEN3_FLAVORS[flavor]
    assert args.num_params() / 1e9 == pytest.approx(total, abs=0.01)
    assert args.num_params(active=True) / 1e9 == pytest.approx(active, abs=0.01)


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_moe"])
def test_spec_counts_and_plan_paths(flavor: str) -> None:
    spec, args, model, plan, blocks = built_on_meta("qwen3", flavor)
    for path in plan.tensor_parallel.root:
        model.get_submodule(path)
    if args.moe is None:
        for path in plan.tensor_parallel.block:
            blocks["0"].get_submodule(path)
    assert plan.context_parallel is not None
    blocks["0"].get_submodule(plan.context_parallel.attention_core)
    # MoE blocks run whole on every TP rank; a flavor mixing dense and MoE blocks is refused.
    style = type(plan.tensor_parallel.block["feed_forward"]).__name__
    assert style == ("ReplicateParallel" if args.moe is not None else "PrepareModuleInput")
    mixed = MODELS["qwen3"].parallel_plan(MOE)  # moe_layers=(0, 2)
    assert "moe_blocks_have_no_tp_layout" in mixed.tensor_parallel.divisible


def _model(args: Qwen3Args, seed: int) -> Transformer:
    model = Transformer(args)
    model.init_weights(seed=seed)
    with torch.no_grad():  # non-trivial norms, so a wrong QK-norm permutation would show
        gen = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
    return model.eval()


def _hf_classes(args: Qwen3Args):
    transformers = pytest.importorskip("transformers")
    if args.moe is None:
        return transformers.Qwen3ForCausalLM, transformers.Qwen3Config
    return transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig


@pytest.mark.parametrize("args", [DENSE, MOE], ids=["dense", "moe"])
def test_export_matches_transformers_logits(args: Qwen3Args, tmp_path: Path) -> None:
    model_cls, _ = _hf_classes(args)
    model = _model(args, seed=3)
    diff = hf_parity.export_logit_diff(model, StateDictAdapter(QWEN3_HF, args), model_cls, tmp_path)
    print(f"ours -> transformers ({model_cls.__name__}): max abs logit diff {diff:.2e}")
    assert diff <= 1e-5, diff


@pytest.mark.parametrize("args", [DENSE, MOE], ids=["dense", "moe"])
def test_import_matches_transformers_logits(args: Qwen3Args, tmp_path: Path) -> None:
    model_cls, config_cls = _hf_classes(args)
    torch.manual_seed(0)
    hf = model_cls(config_cls(**StateDictAdapter(QWEN3_HF, args).hf_config()))
    with torch.no_grad():  # random everything (the HF router starts at zero: all ties)
        for p in hf.parameters():
            p.normal_(0.0, 0.1)
    got, ours, hf_sd = hf_parity.import_hf(hf, tmp_path)
    assert (got.moe, got.moe_layers, got.head_dim) == (args.moe, args.moe_layers, args.head_dim)
    diff = hf_parity.logit_diff(ours.eval(), hf.eval())
    print(f"transformers ({type(hf).__name__}) -> ours: max abs logit diff {diff:.2e}")
    assert diff <= 1e-5, diff
    back = StateDictAdapter(QWEN3_HF, got).to_hf(dict(ours.state_dict()))
    if args.moe is None:  # dense: HF -> ours -> HF is bit-identical
        assert set(back) == set(hf_sd) and all(torch.equal(back[k], hf_sd[k]) for k in hf_sd)


def test_export_refuses_a_trained_routing_bias() -> None:
    model = Transformer(MOE)
    model.init_weights(seed=0)
    sd = dict(model.state_dict())
    sd["layers.0.feed_forward.router.expert_bias"] = torch.ones(8)
    with pytest.raises(ValueError, match="no routing bias"):
        StateDictAdapter(QWEN3_HF, MOE).to_hf(sd)
