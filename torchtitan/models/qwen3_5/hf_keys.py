"""Every Qwen3.5 / Qwen3.5-MoE ``config.json`` key (the text config: ``qwen3_5_text``,
``qwen3_5_moe_text``, or the ``text_config`` of a multimodal ``qwen3_5`` config) and what the
family does with it (``models/common/hf/keys.py``; generated into docs/hf_io.md, "Config
keys"; docs/qwen3_5.md)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torchtitan.models.common.hf.decoder import decoder_keys
from torchtitan.models.common.hf.keys import KeyTable, irrelevant, mapped, only
from torchtitan.models.common.hf.rope import rope_type

KINDS = ("linear_attention", "full_attention")


def _rope(value: Any, config: Mapping[str, Any]) -> tuple[str, str] | None:
    """Default RoPE only; the partial factor is ours; the multimodal sections rotate text
    positions exactly as plain RoPE (the three position rows are equal for text)."""
    if not value:
        return None
    kind = rope_type(value)
    if kind not in (None, "default"):
        return f"rope_type {kind!r}: only default RoPE is implemented for Qwen3.5", "use default"
    return None


def _layer_types(value: Any, config: Mapping[str, Any]) -> tuple[str, str] | None:
    n = config.get("num_hidden_layers")
    if value is None or (len(value) == n and not set(value) - set(KINDS)):
        return None
    return (
        f"must give {KINDS[0]!r} or {KINDS[1]!r} for each of the {n} layers",
        "fix layer_types, or remove it for every 4th layer full_attention",
    )


def _interval(value: Any, config: Mapping[str, Any]) -> tuple[str, str] | None:
    if value is None or (isinstance(value, int) and value >= 1):
        return None
    return "must be an integer >= 1", "use 4 (the published models)"


_TEXT_ONLY = "the text decoder only: the vision tower is not read (docs/qwen3_5.md)"

QWEN35_KEYS = KeyTable(
    "qwen3_5",
    (
        *decoder_keys(),
        mapped("rope_parameters", "rope_theta, partial_rotary_factor (rope_type default)", _rope),
        mapped("rope_scaling", "(transformers < 5) as rope_parameters", _rope),
        mapped("partial_rotary_factor", "partial_rotary_factor (top-level spelling)"),
        mapped("head_dim", "head_dim"),
        mapped("intermediate_size", "intermediate_size (the dense SwiGLU)"),
        mapped("attention_bias", "no projection biases", only(False)),
        mapped("attn_output_gate", "gated attention (wq's gate half)", only(True)),
        mapped("layer_types", "layer_types", _layer_types),
        mapped("full_attention_interval", "layer_types (when it is absent)", _interval),
        mapped("linear_num_key_heads", "linear_num_key_heads"),
        mapped("linear_num_value_heads", "linear_num_value_heads"),
        mapped("linear_key_head_dim", "linear_key_head_dim"),
        mapped("linear_value_head_dim", "linear_value_head_dim"),
        mapped("linear_conv_kernel_dim", "linear_conv_kernel_dim"),
        mapped(
            "mamba_ssm_dtype",
            "the delta rule's state dtype: ours is always float32",
            only("float32", None),
        ),
        mapped("num_experts", "moe.num_experts"),
        mapped("num_experts_per_tok", "moe.top_k"),
        mapped("moe_intermediate_size", "moe.expert_dim"),
        mapped("shared_expert_intermediate_size", "shared_expert_dim"),
        mapped("norm_topk_prob", "moe.route_norm (always on in Qwen3.5-MoE)", only(True)),
        mapped("decoder_sparse_step", "every block MoE", only(1)),
        mapped("mlp_only_layers", "every block MoE", only([], None)),
        irrelevant(
            "router_aux_loss_coef",
            "weights transformers' load-balancing loss pooled over every layer's router logits, "
            "which we do not compute; ours: --model.moe_aux_loss_coef, docs/moe.md",
        ),
        irrelevant("mtp_num_hidden_layers", "the multi-token-prediction head is not read"),
        irrelevant("mtp_use_dedicated_embeddings", "the multi-token-prediction head is not read"),
        mapped("text_config", "the text decoder's args (a multimodal config.json)"),
        irrelevant("vision_config", _TEXT_ONLY),
        irrelevant("image_token_id", _TEXT_ONLY),
        irrelevant("video_token_id", _TEXT_ONLY),
        irrelevant("vision_start_token_id", _TEXT_ONLY),
        irrelevant("vision_end_token_id", _TEXT_ONLY),
    ),
)
"""Qwen3.5's (dense and MoE) ``config.json`` keys."""
