"""LoRA against PEFT (docs/lora.md): on the same base (our HF export) and the same adapters
(our PEFT export), our forward equals ``peft.PeftModel``'s on transformers (fp32, 1e-5) and the
adapter gradients after one backward match (relative 1e-4), for Llama 3, Qwen3, Qwen3-MoE, GPT-OSS
(biased attention projections) and DeepSeek-V3 (every MLA projection: the family's default
targets);
importing the PEFT folder gives back our adapters exactly; grouped-expert adapters (no PEFT
format) equal the merged weights."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from tests.tiny_args import tiny_deepseek_v3, tiny_gpt_oss, tiny_llama3, tiny_qwen3
from torchtitan.config.job_config import Lora
from torchtitan.lora.apply import adapter_names, apply_lora, init_adapters
from torchtitan.lora.layers import is_adapter_name
from torchtitan.lora.peft_io import (
    load_peft_adapters,
    merge_adapters,
    save_peft_adapters,
    to_peft,
)
from torchtitan.models import MODELS
from torchtitan.models.common.moe import MoEArgs

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

ALL = ["attention.wq", "attention.wk", "attention.wv", "attention.wo"]
FFN = ["feed_forward.w1", "feed_forward.w2", "feed_forward.w3"]
QWEN_MOE = dataclasses.replace(
    tiny_qwen3(),
    n_layers=2,
    tie_word_embeddings=False,
    moe=MoEArgs(num_experts=4, top_k=2, expert_dim=32),
    moe_layers=(0,),
)
CASES: dict[str, tuple[str, Any, list[str], Any]] = {
    "llama3": ("llama3", tiny_llama3(dim=64, heads=(4, 2), vocab=256), ALL + FFN, "Llama"),
    "qwen3": ("qwen3", tiny_qwen3(), ALL + FFN, "Qwen3"),
    # Attention only: PEFT 0.21 on transformers 5 rewrites Qwen3-MoE MLP targets to the fused
    # experts (its dense layer's SwiGLU then gets none); our experts: the merged test below.
    "qwen3_moe": ("qwen3", QWEN_MOE, ALL, "Qwen3Moe"),
    # Attention only for both: their routed experts are fused 3-D tensors in transformers.
    "gpt_oss": ("gpt_oss", tiny_gpt_oss(), ALL, "GptOss"),
    "deepseek_v3": (
        "deepseek_v3",
        tiny_deepseek_v3(),
        list(MODELS["deepseek_v3"].lora_targets),  # type: ignore[attr-defined]
        "DeepseekV3",
    ),
}


def lora_model(family: str, args: Any, targets: list[str], rslora: bool = True):
    spec = MODELS[family]
    model = spec.build(args)
    model.init_weights(seed=1)
    cfg = Lora(enable=True, rank=4, alpha=8.0, use_rslora=rslora, target_modules=targets)
    apply_lora(model, cfg)
    init_adapters(model, seed=2)
    with torch.no_grad():  # B starts at zero: give it values so the update shows
        gen = torch.Generator().manual_seed(5)
        for name, p in model.named_parameters():
            if is_adapter_name(name) and "lora_B" in name:
                p.normal_(0.0, 0.2, generator=gen)
    return model, cfg, spec.state_dict_adapter(args)


def hf_with_peft(model: nn.Module, adapter: Any, cfg: Lora, cls: str, tmp: Path):
    from safetensors.torch import save_file

    base = {k: v for k, v in model.state_dict().items() if not is_adapter_name(k)}
    (tmp / "base").mkdir()
    save_file(adapter.to_hf(base), str(tmp / "base" / "model.safetensors"))
    (tmp / "base" / "config.json").write_text(json.dumps(adapter.hf_config()))
    hf = getattr(transformers, f"{cls}ForCausalLM").from_pretrained(
        tmp / "base", dtype=torch.float32, attn_implementation="eager"
    )
    save_peft_adapters(tmp / "peft", dict(model.state_dict()), adapter, cfg, base="ours")
    return peft.PeftModel.from_pretrained(hf, tmp / "peft", is_trainable=True)


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_grads_match_peft(case: str, tmp_path: Path) -> None:
    family, args, targets, cls = CASES[case]
    model, cfg, adapter = lora_model(family, args, targets)
    theirs = hf_with_peft(model, adapter, cfg, cls, tmp_path)
    tokens = _tokens(args.vocab_size)
    ours_logits = model(tokens)
    their_logits = theirs(input_ids=tokens).logits
    diff = (ours_logits - their_logits).abs().max().item()
    (ours_logits.square().mean()).backward()
    (their_logits.square().mean()).backward()
    ours_g = to_peft({n: p.grad for n, p in model.named_parameters() if p.requires_grad}, adapter)
    their_g = {
        k.replace(".default", ""): p.grad for k, p in theirs.named_parameters() if p.requires_grad
    }
    assert set(ours_g) == set(their_g) and len(ours_g) > 0
    worst = max(ours_g, key=lambda k: _rel(ours_g[k], their_g[k]))
    rel = _rel(ours_g[worst], their_g[worst])
    print(f"{case}: max abs logit diff {diff:.2e}; worst grad {worst} rel {rel:.2e}")
    assert diff <= 1e-5, diff
    assert rel <= 1e-4, (worst, rel)
    assert all(p.grad is None for n, p in model.named_parameters() if not is_adapter_name(n))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


MTP_CASE = ("deepseek_v3", tiny_deepseek_v3(mtp_depth=1), CASES["deepseek_v3"][2], "")


@pytest.mark.parametrize("case", [CASES["llama3"], MTP_CASE], ids=["llama3", "deepseek_v3_mtp"])
def test_peft_folder_round_trips(case: tuple[str, Any, list[str], str], tmp_path: Path) -> None:
    """Every adapter of the model, DeepSeek-V3's MTP block included (its HF layer n_layers + k,
    as the weights export names it), is written and read back bitwise."""
    family, args, targets, _ = case
    model, cfg, adapter = lora_model(family, args, targets)
    sd = dict(model.state_dict())
    save_peft_adapters(tmp_path, sd, adapter, cfg, base="base")
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["use_rslora"] is True
    modules = sorted({n.rsplit(".", 1)[0] for n in adapter_names(model)})
    got, got_cfg = load_peft_adapters(tmp_path, adapter, modules)
    assert (got_cfg.rank, got_cfg.alpha, got_cfg.use_rslora) == (4, 8.0, True)
    assert set(got) == {k for k in sd if is_adapter_name(k)}
    assert all(torch.equal(got[k], sd[k]) for k in got)  # the RoPE row order undone exactly
    if family == "deepseek_v3":  # the MTP block's adapters under layer n_layers + 0
        written = load_file(str(tmp_path / "adapter_model.safetensors"))
        layer = f"base_model.model.model.layers.{args.n_layers}.self_attn."
        assert any(k.startswith(layer) for k in written), sorted(written)[:4]


def test_merged_weights_equal_lora_forward_with_experts() -> None:
    model, cfg, _ = lora_model("qwen3", QWEN_MOE, [*ALL, "feed_forward.experts"])
    assert any("experts.lora_A_w2" in n for n in adapter_names(model))
    tokens = _tokens(QWEN_MOE.vocab_size)
    with torch.no_grad():
        ours = model(tokens)
        plain = MODELS["qwen3"].build(QWEN_MOE)
        plain.load_state_dict(merge_adapters(dict(model.state_dict()), cfg))
        plain.init_buffers()
        merged = plain(tokens)
    diff = (ours - merged).abs().max().item()
    print(f"grouped-expert LoRA vs merged weights: max abs logit diff {diff:.2e}")
    assert diff <= 1e-5, diff
    with pytest.raises(ValueError, match="grouped-expert adapters"):
        to_peft(dict(model.state_dict()), MODELS["qwen3"].state_dict_adapter(QWEN_MOE))
