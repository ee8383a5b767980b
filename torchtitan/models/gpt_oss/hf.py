"""GPT-OSS's Hugging Face format (``GptOssForCausalLM``), declared for the shared adapter
(``models/common/hf/``; docs/extending.md, section 5; docs/gpt_oss.md):

- the Llama-style names plus the projection biases, ``self_attn.sinks`` (ours
  ``attention.core.sinks``) and the router (``mlp.router.weight``/``bias``);
- ``wq``/``wk`` rows and their biases permuted between our adjacent-pair RoPE and HF's halves;
- the experts are stored as HF holds them (``mlp.experts.gate_up_proj [E, dim, 2H]`` with gate
  and up interleaved, its bias, ``down_proj [E, H, dim]``, its bias): renamed, not transformed;
- the auxiliary-loss-free routing bias has no HF counterpart: it must be zero to export;
- ``router_aux_loss_coef`` is neither imported nor exported: it weights transformers'
  load-balancing loss (one ``E * sum_e f_e * P_e`` over the router logits of every layer and
  token together, only with ``output_router_logits``), whose gradients differ from our per-layer,
  per-sequence auxiliary loss (``models/common/moe.py``), so taking its value for ours would train a different objective. An imported model has our
  auxiliary loss off (``--model.moe_aux_loss_coef C`` turns it on, docs/moe.md); an export keeps
  transformers' default;
- ``config.json``: ``layer_types``, ``sliding_window``, the YaRN ``rope_parameters``, the
  experts' fields and the SwiGLU clamp. MXFP4-quantized checkpoints (the published
  ``*_blocks``/``*_scales`` tensors) are refused: dequantize them with transformers first.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torchtitan.models.common.hf import ConfigField, HFConfig, HFMapping, OursOnly
from torchtitan.models.common.hf import decoder as hf_decoder
from torchtitan.models.common.hf.mapping import RopeRows
from torchtitan.models.common.hf.rope import rope_params, yarn_from_params
from torchtitan.models.common.moe import MoEArgs
from torchtitan.models.gpt_oss.args import GptOssArgs, alternating_layers
from torchtitan.models.gpt_oss.hf_keys import GPT_OSS_KEYS


class _ShapeSection:
    """``layer_types``, YaRN ``rope_parameters``, the experts' fields."""

    def to_hf(self, a: GptOssArgs) -> dict[str, Any]:
        m = a.moe
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": a.rope_theta}
        if a.yarn is not None:
            y = a.yarn
            rope.update(
                hf_decoder.yarn_to_hf(y.factor, y.original_max_seq_len, y.beta_fast, y.beta_slow)
            )
            rope["truncate"] = y.truncate
            if y.attention_factor is not None:
                rope["attention_factor"] = y.attention_factor
        return {
            "layer_types": list(a.layer_types or alternating_layers(a.n_layers)),
            "rope_parameters": rope,
            "num_local_experts": m.num_experts,
            "num_experts_per_tok": m.top_k,
            "intermediate_size": m.expert_dim,
        }

    def from_hf(self, config: Mapping[str, Any]) -> dict[str, Any]:
        if config.get("quantization_config"):
            raise ValueError(
                "quantized GPT-OSS checkpoint (MXFP4 *_blocks/*_scales): dequantize it with "
                "transformers (Mxfp4Config(dequantize=True)) and save it in bf16 first"
            )
        rope = rope_params(config)  # transformers: rope_scaling wins over rope_parameters
        kwargs: dict[str, Any] = {
            "moe": MoEArgs(
                num_experts=int(config.get("num_local_experts") or config["num_experts"]),
                top_k=config["num_experts_per_tok"],
                expert_dim=config["intermediate_size"],
                # Not ``router_aux_loss_coef``: see the module docstring.
                aux_loss_coef=0.0,
            )
        }
        types = tuple(config.get("layer_types") or ())
        if types and types != alternating_layers(config["num_hidden_layers"]):
            kwargs["layer_types"] = types  # None stands for the published alternation
        rope_type = rope.get("rope_type", "default")
        if rope_type == "yarn":
            kwargs["yarn"] = yarn_from_params(rope, config)
        elif rope_type == "default":
            kwargs["yarn"] = None
        else:
            raise ValueError(f"GPT-OSS: rope_type {rope_type!r} is not supported")
        return kwargs


_CONFIG = HFConfig(
    make_args=GptOssArgs,
    constants=hf_decoder.decoder_constants("GptOssForCausalLM", "gpt_oss", attention_bias=True),
    fields=(
        *hf_decoder.decoder_fields(
            kv_heads=8, norm_eps=1e-5, rope_theta=150000.0, max_seq_len=131072
        ),
        ConfigField("head_dim", "head_dim", default=64),
        ConfigField("sliding_window", "sliding_window", default=128),
        ConfigField("swiglu_limit", "swiglu_limit", default=7.0),
        ConfigField("swiglu_alpha", "swiglu_alpha", default=1.702),
    ),
    sections=(_ShapeSection(),),
    keys=GPT_OSS_KEYS,
)

_BIASES = {
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "attention.wo.bias": "self_attn.o_proj.bias",
}
_EXPERTS = {
    f"feed_forward.experts.{name}": f"mlp.experts.{name}"
    for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
}
_NO_BIAS = (
    "auxiliary-loss-free balancing; Hugging Face's GPT-OSS has no such bias (its router's "
    "bias is trained), the exported model would route differently"
)

GPT_OSS_HF = HFMapping(
    top=hf_decoder.DECODER_TOP,
    layer={
        **hf_decoder.ATTENTION,
        **_BIASES,
        "attention.core.sinks": "self_attn.sinks",
        **hf_decoder.BLOCK_NORMS,
        "feed_forward.router.gate.weight": "mlp.router.weight",
        "feed_forward.router.gate.bias": "mlp.router.bias",
        **_EXPERTS,
    },
    transforms={
        **hf_decoder.ROPE_QK,
        "attention.wq.bias": RopeRows("n_heads"),
        "attention.wk.bias": RopeRows("kv_heads"),
    },
    ours_only={
        "feed_forward.router.expert_bias": OursOnly("feed_forward.router.gate.weight", _NO_BIAS)
    },
    config=_CONFIG,
)
"""GPT-OSS <-> ``GptOssForCausalLM``."""


def args_from_hf_config(config: Mapping[str, Any]) -> GptOssArgs:
    """Our args for a Hugging Face GPT-OSS ``config.json``."""
    args: GptOssArgs = GPT_OSS_HF.config.args_from_hf(config)
    return args


__all__ = ["GPT_OSS_HF", "args_from_hf_config"]
