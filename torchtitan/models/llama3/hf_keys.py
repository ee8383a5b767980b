"""Every Llama ``config.json`` key and what Llama 3 does with it (``models/common/hf/keys.py``;
the table is generated into docs/hf_io.md, "Config keys")."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torchtitan.models.common.hf.decoder import decoder_keys, no_window_keys
from torchtitan.models.common.hf.keys import KeyTable, irrelevant, mapped, only
from torchtitan.models.common.hf.rope import rope_keys


def _head_dim(value: Any, config: Mapping[str, Any]) -> tuple[str, str] | None:
    derived = config["hidden_size"] // config["num_attention_heads"]
    if value in (None, derived):
        return None
    return (
        f"Llama 3's head width is hidden_size // num_attention_heads = {derived}",
        f"set head_dim to {derived} (a free head width is Qwen3's)",
    )


LLAMA3_KEYS = KeyTable(
    "llama3",
    (
        *decoder_keys(),
        *rope_keys(),
        *no_window_keys("llama3"),
        mapped("head_dim", "head_dim (hidden_size // num_attention_heads)", _head_dim),
        mapped("intermediate_size", "multiple_of (the SwiGLU width, read back exactly)"),
        mapped("attention_bias", "no projection biases", only(False)),
        mapped("mlp_bias", "no feed-forward biases", only(False)),
        irrelevant("pretraining_tp", "transformers 4 sliced its matmuls by it: the same function"),
    ),
)
"""Llama 3's ``config.json`` keys."""
