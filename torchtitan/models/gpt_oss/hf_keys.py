"""Every GPT-OSS ``config.json`` key and what we do with it (``models/common/hf/keys.py``;
generated into docs/hf_io.md, "Config keys")."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torchtitan.models.common.hf.decoder import decoder_keys
from torchtitan.models.common.hf.keys import KeyTable, irrelevant, mapped, only, refused
from torchtitan.models.common.hf.rope import rope_keys
from torchtitan.models.gpt_oss.args import FULL, SLIDING


def _layer_types(value: Any, config: Mapping[str, Any]) -> tuple[str, str] | None:
    n = config["num_hidden_layers"]
    if value is None or (len(value) == n and not set(value) - {SLIDING, FULL}):
        return None
    return f"must give {SLIDING!r} or {FULL!r} for each of the {n} layers", "fix layer_types"


GPT_OSS_KEYS = KeyTable(
    "gpt_oss",
    (
        *decoder_keys(),
        *rope_keys("yarn", ("default", "yarn")),
        mapped("head_dim", "head_dim"),
        mapped("sliding_window", "sliding_window"),
        mapped("layer_types", "layer_types", _layer_types),
        mapped("swiglu_limit", "swiglu_limit"),
        mapped("swiglu_alpha", "swiglu_alpha"),
        mapped("num_local_experts", "moe.num_experts"),
        mapped("num_experts", "moe.num_experts (older configs)"),
        mapped("num_experts_per_tok", "moe.top_k"),
        mapped("intermediate_size", "moe.expert_dim"),
        irrelevant(
            "router_aux_loss_coef",
            "weights transformers' load-balancing loss pooled over every layer's router logits, which "
            "we do not compute (gradients differ); ours: --model.moe_aux_loss_coef, docs/moe.md",
        ),
        mapped(
            "attention_bias",
            "the projection biases",
            only(True, what="GPT-OSS's projections have biases"),
        ),
        irrelevant("use_sliding_window", "GPT-OSS windows the layers layer_types names"),
        refused(
            "quantization_config",
            "MXFP4 weights are not read; dequantize with transformers (Mxfp4Config(dequantize=True)) first",
        ),
    ),
)
"""GPT-OSS's ``config.json`` keys."""
