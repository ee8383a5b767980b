"""Per-expert adapters on every family's stacked experts (docs/lora.md): the shared ``Experts``
(Qwen3-MoE) and GPT-OSS's biased clamped-SwiGLU ``GptOssExperts`` take adapters through the one
``StackedExperts.project`` hook. With adapters the forward equals the model whose expert weights
have the adapters merged (``w[e] + s A[e] B[e]``; fp32, 1e-5), and the adapter gradients equal
those of that merged model taken with respect to ``A`` and ``B`` (relative 1e-4): a reference
that differentiates through the merge instead of the low-rank path."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.func import functional_call

from tests.tiny_args import tiny_gpt_oss
from tests.unit.test_lora_peft import QWEN_MOE, lora_model
from torchtitan.config.job_config import Lora
from torchtitan.lora.layers import LoRAExperts, is_adapter_name, lora_scaling
from torchtitan.lora.peft_io import merge_adapters, to_peft
from torchtitan.models import MODELS

CASES: dict[str, tuple[str, Any, tuple[str, ...]]] = {
    "qwen3_moe": ("qwen3", QWEN_MOE, ("w1", "w2", "w3")),
    "gpt_oss": ("gpt_oss", tiny_gpt_oss(), ("gate_up_proj", "down_proj")),
}
TARGETS = ["attention.wq", "attention.wo", "feed_forward.experts"]


def _lora_model(family: str, args: Any) -> tuple[torch.nn.Module, Lora]:
    model, cfg, _ = lora_model(family, args, TARGETS)
    return model, cfg


def _merged(sd: dict[str, torch.Tensor], s: float) -> dict[str, torch.Tensor]:
    """``merge_adapters`` kept differentiable in the adapters (``W + s B A``, ``w + s A B``)."""
    out = {k: v for k, v in sd.items() if not is_adapter_name(k)}
    for key, a in sd.items():
        module, _, leaf = key.rpartition(".")
        if leaf == "lora_A":
            out[f"{module}.weight"] = out[f"{module}.weight"] + s * (sd[f"{module}.lora_B"] @ a)
        elif leaf.startswith("lora_A_"):
            w = leaf.removeprefix("lora_A_")
            b = sd[f"{module}.lora_B_{w}"]
            out[f"{module}.{w}"] = out[f"{module}.{w}"] + s * torch.bmm(a, b)
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("case", list(CASES))
def test_expert_adapters_equal_merged_weights(case: str) -> None:
    family, args, projections = CASES[case]
    model, cfg = _lora_model(family, args)
    experts = model.get_submodule("layers.0.feed_forward.experts")
    assert isinstance(experts, LoRAExperts) and experts.adapted == projections
    tokens = torch.randint(0, args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    ours = model(tokens)
    (ours.square().mean()).backward()

    plain = MODELS[family].build(args)
    plain.load_state_dict(merge_adapters(dict(model.state_dict()), cfg))
    plain.init_buffers()
    with torch.no_grad():
        diff = (ours - plain(tokens)).abs().max().item()

    s = lora_scaling(cfg.rank, cfg.alpha, cfg.use_rslora)
    sd = {
        k: v.detach().clone().requires_grad_(is_adapter_name(k))
        for k, v in model.state_dict().items()
    }
    ref = functional_call(plain, _merged(sd, s), (tokens,))
    (ref.square().mean()).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert any(f"lora_A_{projections[0]}" in n for n in grads)
    worst = max(grads, key=lambda n: _rel(grads[n], sd[n].grad))
    rel = _rel(grads[worst], sd[worst].grad)
    print(
        f"{case}: expert LoRA vs merged max abs logit diff {diff:.2e}; worst grad {worst} {rel:.2e}"
    )
    assert diff <= 1e-5, diff
    assert rel <= 1e-4, (worst, rel)
    assert all(p.grad is None for n, p in model.named_parameters() if not is_adapter_name(n))
    with pytest.raises(ValueError, match="grouped-expert adapters"):  # PEFT has no 3-D form
        to_peft(dict(model.state_dict()), MODELS[family].state_dict_adapter(args))
