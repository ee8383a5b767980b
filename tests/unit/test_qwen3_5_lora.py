"""LoRA on Qwen3.5 against PEFT (docs/lora.md, docs/qwen3_5.md): the family's default targets
(gated attention's q/k/v/o, the DeltaNet's fused ``wqkv``, ``wz`` and ``wo``) plus the SwiGLU,
exported in PEFT's format onto our Hugging Face export: our forward equals ``peft.PeftModel``'s
on transformers' ``Qwen3_5ForCausalLM`` (fp32, 1e-5 relative) and every adapter gradient matches
(relative 1e-4); the PEFT folder imports back exactly."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.unit import test_lora_peft as lp
from tests.unit.test_qwen3_5 import DENSE
from torchtitan.lora.apply import adapter_names
from torchtitan.lora.layers import is_adapter_name
from torchtitan.lora.peft_io import load_peft_adapters, save_peft_adapters, to_peft
from torchtitan.models import MODELS

TARGETS = [*MODELS["qwen3_5"].lora_targets, *lp.FFN]  # type: ignore[attr-defined]


def test_forward_and_grads_match_peft(tmp_path: Path) -> None:
    model, cfg, adapter = lp.lora_model("qwen3_5", DENSE, TARGETS)
    theirs = lp.hf_with_peft(model, adapter, cfg, "Qwen3_5", tmp_path)
    tokens = lp._tokens(DENSE.vocab_size)
    ours_logits, their_logits = model(tokens), theirs(input_ids=tokens).logits
    diff = lp._rel(ours_logits, their_logits)  # the deeper, hybrid model: relative
    ours_logits.square().mean().backward()
    their_logits.square().mean().backward()
    ours_g = to_peft({n: p.grad for n, p in model.named_parameters() if p.requires_grad}, adapter)
    their_g = {
        k.replace(".default", ""): p.grad for k, p in theirs.named_parameters() if p.requires_grad
    }
    assert set(ours_g) == set(their_g)
    assert any("in_proj_qkv" in k for k in ours_g) and any("out_proj" in k for k in ours_g)
    worst = max(ours_g, key=lambda k: lp._rel(ours_g[k], their_g[k]))
    rel = lp._rel(ours_g[worst], their_g[worst])
    print(f"qwen3_5: max rel logit diff {diff:.2e}; worst grad {worst} rel {rel:.2e}")
    assert diff <= 1e-5, diff
    assert rel <= 1e-4, (worst, rel)


def test_peft_folder_round_trips(tmp_path: Path) -> None:
    """The DeltaNet's ``wqkv`` adapter rows go out in HF's [q | k | v] order and come back
    grouped by key head, exactly."""
    model, cfg, adapter = lp.lora_model("qwen3_5", DENSE, TARGETS)
    sd = dict(model.state_dict())
    save_peft_adapters(tmp_path, sd, adapter, cfg, base="base")
    modules = sorted({n.rsplit(".", 1)[0] for n in adapter_names(model)})
    got, _ = load_peft_adapters(tmp_path, adapter, modules)
    assert set(got) == {k for k in sd if is_adapter_name(k)}
    assert any("linear_attn.wqkv" in k for k in got)
    assert all(torch.equal(got[k], sd[k]) for k in got)
