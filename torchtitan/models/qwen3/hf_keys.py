"""Every Qwen3 / Qwen3-MoE ``config.json`` key and what Qwen3 does with it
(``models/common/hf/keys.py``; generated into docs/hf_io.md, "Config keys"), and the sliding
window's translation: transformers' dense Qwen3 windows the blocks its ``layer_types`` name
``sliding_attention`` (by default those from ``max_window_layers`` on) when
``use_sliding_window`` is true; its Qwen3-MoE windows every block and reads neither
``layer_types`` nor ``max_window_layers``. A window key absent is transformers' default
(``sliding_window`` 4096, ``max_window_layers`` 28)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torchtitan.models.common.hf.decoder import decoder_keys
from torchtitan.models.common.hf.keys import KeyTable, irrelevant, mapped, only
from torchtitan.models.common.hf.rope import rope_keys

SLIDING, FULL = "sliding_attention", "full_attention"
_MOE_NOTE = "; Qwen3-MoE windows every block and ignores it (as transformers does)"


def _layer_types(value: Any, config: Mapping[str, Any]) -> tuple[str, str] | None:
    if value is None or config.get("model_type") == "qwen3_moe":
        return None
    if len(value) != config["num_hidden_layers"] or set(value) - {SLIDING, FULL}:
        return (
            f"must give {SLIDING!r} or {FULL!r} for each of the {config['num_hidden_layers']} "
            "layers",
            "fix layer_types",
        )
    if SLIDING in value and not config.get("use_sliding_window"):
        return (
            f"names {SLIDING!r} layers while use_sliding_window is false (transformers then "
            "has no window size for them)",
            "set use_sliding_window: true or make every layer full_attention",
        )
    return None


def window_from_hf(config: Mapping[str, Any]) -> dict[str, Any]:
    """``sliding_window`` and ``window_layers`` of our args, as transformers applies them."""
    window = config.get("sliding_window", 4096) if config.get("use_sliding_window") else None
    n = config["num_hidden_layers"]
    if window is None:
        return {"sliding_window": None, "window_layers": None}
    if config.get("model_type") == "qwen3_moe":
        layers = list(range(n))
    elif config.get("layer_types"):
        layers = [i for i, t in enumerate(config["layer_types"]) if t == SLIDING]
    else:
        layers = list(range(min(config.get("max_window_layers", 28), n), n))
    if not layers:
        return {"sliding_window": None, "window_layers": None}
    return {
        "sliding_window": int(window),
        "window_layers": None if len(layers) == n else tuple(layers),
    }


def window_to_hf(a: Any) -> dict[str, Any]:
    """The window keys transformers reads back into the same attention."""
    n, moe = a.n_layers, a.moe is not None
    windowed = [a.window(i) is not None for i in range(n)]
    if moe and any(windowed) and not all(windowed):
        raise ValueError("Qwen3-MoE in transformers windows every block or none")
    out: dict[str, Any] = {"use_sliding_window": any(windowed), "sliding_window": a.sliding_window}
    if moe:
        return out
    first = windowed.index(True) if any(windowed) else n
    out["max_window_layers"] = first
    out["layer_types"] = [SLIDING if w else FULL for w in windowed]
    return out


QWEN3_KEYS = KeyTable(
    "qwen3",
    (
        *decoder_keys(),
        *rope_keys(),
        mapped("head_dim", "head_dim"),
        mapped("intermediate_size", "intermediate_size (the dense SwiGLU)"),
        mapped("attention_bias", "no projection biases", only(False)),
        mapped("use_sliding_window", "sliding_window (None when false)"),
        mapped("sliding_window", "sliding_window"),
        mapped("max_window_layers", "window_layers (dense: the blocks from it on)" + _MOE_NOTE),
        mapped(
            "layer_types",
            "window_layers (dense: its sliding_attention blocks)" + _MOE_NOTE,
            _layer_types,
        ),
        mapped("num_experts", "moe.num_experts (transformers < 5)"),
        mapped("num_local_experts", "moe.num_experts"),
        mapped("num_experts_per_tok", "moe.top_k"),
        mapped("moe_intermediate_size", "moe.expert_dim"),
        mapped("norm_topk_prob", "moe.route_norm"),
        mapped("decoder_sparse_step", "moe_layers"),
        mapped("mlp_only_layers", "moe_layers (their complement)"),
        irrelevant(
            "router_aux_loss_coef",
            "weights transformers' load-balancing loss pooled over every layer's router logits, which "
            "we do not compute (gradients differ); ours: --model.moe_aux_loss_coef, docs/moe.md",
        ),
    ),
)
"""Qwen3's (dense and MoE) ``config.json`` keys."""
