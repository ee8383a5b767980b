"""DeepSeek-V3's Hugging Face paths against transformers (fp32, tiny random configs): the MLA
biases of ``attention_bias: true`` through every import (whole dict, the streamed box import of
training and the converter, the evaluation loader) and the export, and the multi-token-prediction
layers in every conversion path (whole dict, streamed, ``torchtitan.convert`` both ways; the
release's layer ``n_layers + k``), including a folder transformers saved, whose ``config.json``
declares ``num_nextn_predict_layers: 1`` and which holds no MTP weights (docs/deepseek_v3.md)."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests import hf_parity
from tests.tiny_args import tiny_deepseek_v3
from torchtitan import convert
from torchtitan.checkpoint import hf_io
from torchtitan.config.errors import ConfigError
from torchtitan.eval.loading import load_weights
from torchtitan.models.deepseek_v3 import DeepSeekV3Args, Transformer
from torchtitan.models.deepseek_v3.hf import DEEPSEEK_V3_HF, DeepSeekV3Adapter

transformers = pytest.importorskip("transformers")

BIASED = tiny_deepseek_v3(attention_bias=True)
BIASED_LITE = tiny_deepseek_v3(attention_bias=True, q_lora_rank=0)
MTP = tiny_deepseek_v3(mtp_depth=1)


def _adapter(args: DeepSeekV3Args) -> DeepSeekV3Adapter:
    return DeepSeekV3Adapter(DEEPSEEK_V3_HF, args)


def _hf_model(args: DeepSeekV3Args, seed: int = 1):
    config = transformers.DeepseekV3Config(**_adapter(args).hf_config())
    torch.manual_seed(seed)
    hf = transformers.DeepseekV3ForCausalLM(config)
    with torch.no_grad():  # random everything: biases, norms, the routing bias
        for name, p in hf.named_parameters():
            p.copy_(
                1.0 + 0.3 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p)
            )
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    hf.config._attn_implementation = "eager"
    return hf


def _ours(args: DeepSeekV3Args, seed: int = 3) -> Transformer:
    model = Transformer(args)
    model.init_weights(seed=seed)
    with torch.no_grad():  # non-trivial norms, biases and routing bias
        gen = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.normal_(0.0, 0.05, generator=gen)
    return model


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


@pytest.mark.parametrize("args", [BIASED, BIASED_LITE], ids=["v3", "lite"])
def test_attention_bias_import_logits_and_grads(args: DeepSeekV3Args, tmp_path: Path) -> None:
    """transformers' q_a_proj / kv_a_proj_with_mqa / o_proj biases reach our wq_a / wkv_a / wo:
    logits and every gradient within 1e-5 relative of transformers'."""
    hf = _hf_model(args)
    got, ours, hf_sd = hf_parity.import_hf(hf, tmp_path)
    assert got.attention_bias and any(k.endswith("o_proj.bias") for k in hf_sd)
    tokens = hf_parity.tokens()
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    logits, ref = ours.train()(inputs), hf.train()(inputs).logits
    assert _rel(logits, ref) <= 1e-5, _rel(logits, ref)
    F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    F.cross_entropy(ref.flatten(0, 1), labels.flatten()).backward()
    ref_grads = _adapter(got).from_hf({n: p.grad for n, p in hf.named_parameters()})
    rel = {n: _rel(p.grad, ref_grads[n]) for n, p in ours.named_parameters()}
    worst = max(rel, key=rel.__getitem__)
    print(
        f"attention_bias import: logits rel {_rel(logits, ref):.1e}, grads {worst} {rel[worst]:.1e}"
    )
    assert rel[worst] <= 1e-5, (worst, rel[worst])
    assert {"layers.0.attention.wo.bias", "layers.0.attention.wkv_a.bias"} <= set(rel)


def test_attention_bias_streamed_and_eval_loader(tmp_path: Path) -> None:
    """The streamed box import (training, the converter) and the evaluation loader read the
    biases too: the same tensors as the whole-dict import, bitwise."""
    hf = _hf_model(BIASED)
    got, ours, _ = hf_parity.import_hf(hf, tmp_path)
    streamed = Transformer(got)
    hf_io.load_hf_state_dict(dict(streamed.state_dict()), _adapter(got), tmp_path)
    family, eval_args, eval_sd = load_weights(tmp_path, hf=True, model="", flavor="")
    assert family == "deepseek_v3" and eval_args == got
    want = ours.state_dict()
    for sd in (streamed.state_dict(), eval_sd):
        assert set(sd) == set(want) and all(torch.equal(sd[k], want[k]) for k in want)


@pytest.mark.parametrize("args", [BIASED, BIASED_LITE], ids=["v3", "lite"])
def test_attention_bias_export_logits(args: DeepSeekV3Args, tmp_path: Path) -> None:
    model = _ours(args)
    hf_class = transformers.DeepseekV3ForCausalLM
    diff = hf_parity.export_logit_diff(model, _adapter(args), hf_class, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["attention_bias"] is True
    assert diff <= 1e-5, diff


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, bad


def test_mtp_streamed_export_and_import(tmp_path: Path) -> None:
    """The streamed export writes the MTP module as layer n_layers (with the release's copies of
    the embedding and head), the streamed import reads it back bitwise, and transformers reads
    the folder's trunk with our logits."""
    model = _ours(MTP)
    adapter = _adapter(MTP)
    sd = dict(model.state_dict())
    hf_io.save_hf_streaming(sd, adapter, tmp_path)
    names = set(json.loads((tmp_path / hf_io.INDEX).read_text())["weight_map"])
    n = MTP.n_layers
    for name in (
        "eh_proj",
        "enorm",
        "hnorm",
        "shared_head.norm",
        "shared_head.head",
        "embed_tokens",
    ):
        assert f"model.layers.{n}.{name}.weight" in names, name
    assert f"model.layers.{n}.self_attn.kv_a_proj_with_mqa.weight" in names
    assert names == set(adapter.to_hf(sd))  # the whole-dict export names the same tensors
    back = Transformer(MTP)
    hf_io.load_hf_state_dict(dict(back.state_dict()), adapter, tmp_path)
    _same(dict(back.state_dict()), sd)
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, attn_implementation="eager"
    )
    diff = hf_parity.logit_diff(model.eval(), hf.eval())
    print(f"MTP export: trunk logits max abs diff vs transformers {diff:.1e}")
    assert diff <= 1e-5, diff


def test_mtp_convert_round_trip(tmp_path: Path) -> None:
    """``torchtitan.convert`` with MTP: ours -> HF (whole dict) -> from-hf (DCP) -> to-hf ->
    streamed import: every tensor bitwise equal; the DCP checkpoint holds the MTP module."""
    model = _ours(MTP, seed=5)
    sd = dict(model.state_dict())
    hf_parity.export_hf(model, _adapter(MTP), tmp_path)
    step = convert.from_hf(tmp_path, tmp_path / "ckpt", "deepseek_v3")
    assert "mtp.0.eh_proj.weight" in convert._checkpoint_shapes(step)
    out = tmp_path / "back"
    convert.to_hf(step, out, "deepseek_v3", MTP, None)
    back = Transformer(MTP)
    hf_io.load_hf_state_dict(dict(back.state_dict()), _adapter(MTP), out)
    _same(dict(back.state_dict()), sd)


def _saved_by_transformers(tmp_path: Path) -> Path:
    hf = _hf_model(BIASED)
    hf.config.num_nextn_predict_layers = 1  # transformers' default; it saves no MTP weights
    hf.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["num_nextn_predict_layers"] == 1
    return tmp_path


def test_folder_without_mtp_weights(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A transformers-saved folder: the converter and the evaluation loader import the trunk
    (mtp_depth 0) and log why; a training import into a model with MTP is refused in one line
    naming the fix, before any weight is read."""
    folder = _saved_by_transformers(tmp_path / "hf")
    with caplog.at_level(logging.WARNING):
        step = convert.from_hf(folder, tmp_path / "ckpt", "deepseek_v3")
        _, args, sd = load_weights(folder, hf=True, model="", flavor="")
    assert args.mtp_depth == 0 and not any(k.startswith("mtp.") for k in sd)
    assert not any(k.startswith("mtp.") for k in convert._checkpoint_shapes(step))
    assert "num_nextn_predict_layers=1 but the weights hold 0" in caplog.text
    with_mtp = dataclasses.replace(args, mtp_depth=1)
    model = Transformer(with_mtp)
    with pytest.raises(ConfigError, match=r"--model.mtp_depth 0") as e:
        hf_io.load_hf_state_dict(dict(model.state_dict()), _adapter(with_mtp), folder)
    assert "\n" not in str(e.value) and "model.layers.3.eh_proj.weight is absent" in str(e.value)


@pytest.mark.parametrize(
    "key",
    [
        "first_k_dense_replace",
        "n_shared_experts",
        "norm_topk_prob",
        "routed_scaling_factor",
        "n_group",
        "topk_group",
    ],
)
def test_an_absent_moe_key_means_transformers_default(key: str) -> None:
    """A ``config.json`` without one of the routing keys builds, in transformers, the model of
    that key's class default (``routed_scaling_factor`` 2.5, ``n_group`` 8, ...): our import reads
    the same value (it read 1.0 for the scaling factor: a silently different router)."""
    args = dataclasses.replace(tiny_deepseek_v3(), n_layers=4)
    full = _adapter(args).hf_config()
    full.update(n_routed_experts=16, n_group=8, topk_group=4)  # valid beside the defaults
    full.pop(key)
    theirs = transformers.DeepseekV3Config(**full)
    ours = DEEPSEEK_V3_HF.config.args_from_hf(full)
    assert ours.n_dense_layers == min(theirs.first_k_dense_replace, theirs.num_hidden_layers)
    assert ours.moe is not None or theirs.first_k_dense_replace >= theirs.num_hidden_layers
    if ours.moe is not None:
        moe = ours.moe
        assert moe.num_shared_experts == theirs.n_shared_experts
        assert moe.route_norm == theirs.norm_topk_prob
        assert moe.route_scale == theirs.routed_scaling_factor
        assert (moe.n_groups, moe.topk_groups) == (theirs.n_group, theirs.topk_group)
