"""GPT-OSS's ``router_aux_loss_coef`` (docs/gpt_oss.md, docs/hf_io.md): transformers' load-
balancing loss is not ours (pooled over every layer's router logits; ours per layer and
sequence), so the coefficient is neither imported nor exported. Measured here: with the same
coefficient on the same weights, the router gradients of the two losses differ."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from tests import hf_parity
from tests.tiny_args import tiny_gpt_oss
from torchtitan.models import MODELS

transformers = pytest.importorskip("transformers")

ARGS = tiny_gpt_oss()


def _hf(coef: float):
    config = MODELS["gpt_oss"].state_dict_adapter(ARGS).hf_config()
    config.update(router_aux_loss_coef=coef, output_router_logits=True)
    torch.manual_seed(0)
    hf = transformers.GptOssForCausalLM(transformers.GptOssConfig(**config))
    hf.config._attn_implementation = "eager"
    return hf


def test_router_aux_loss_coef_is_not_imported_or_exported(tmp_path: Path) -> None:
    hf = _hf(0.9)
    args, _, _ = hf_parity.import_hf(hf, tmp_path)
    assert args.moe.aux_loss_coef == 0.0  # ours stays off: --model.moe_aux_loss_coef sets it
    exported = MODELS["gpt_oss"].state_dict_adapter(args).hf_config()
    assert "router_aux_loss_coef" not in exported


def test_transformers_balancing_loss_is_another_objective(tmp_path: Path) -> None:
    """Why: the router gradients of transformers' aux loss and ours, same weights, same
    coefficient, are far apart (more than 1% relative on every layer's router)."""
    coef = 0.5
    hf = _hf(coef)
    args, ours, _ = hf_parity.import_hf(hf, tmp_path)
    ours = MODELS["gpt_oss"].build(
        dataclasses.replace(args, moe=dataclasses.replace(args.moe, aux_loss_coef=coef))
    )
    ours.load_state_dict(MODELS["gpt_oss"].state_dict_adapter(args).from_hf(hf.state_dict()))
    ours.init_buffers()
    tokens = hf_parity.tokens()
    (ours.train()(tokens) * 0.0).sum().backward()  # only the auxiliary loss's gradient
    (hf.train()(tokens).aux_loss * coef).backward()
    rels = []
    for i in range(args.n_layers):
        g = ours.get_parameter(f"layers.{i}.feed_forward.router.gate.weight").grad
        r = hf.model.layers[i].mlp.router.weight.grad
        assert g is not None and r is not None and g.abs().max() > 0 and r.abs().max() > 0
        rel = ((g - r).abs().max() / r.abs().max()).item()
        rels.append(rel)
    print(f"router gradients, ours vs transformers' balancing loss, per layer: {rels}")
    assert min(rels) > 0.01, rels
