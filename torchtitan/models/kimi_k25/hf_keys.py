"""The top-level keys of a Kimi K2.5 ``config.json`` (``kimi_k25``: transformers' layout and the
published checkpoints' remote-code one) and what ``kimi_k25`` does with them
(``models/common/hf/keys.py``; generated into docs/hf_io.md, "Config keys"). ``text_config`` is
checked by DeepSeek-V3's table (``models/deepseek_v3/hf_keys.py``), ``vision_config`` by
``hf.py: vision_from_hf``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torchtitan.models.common.hf.keys import KeyTable, irrelevant, mapped


def _vision_width(config: Mapping[str, Any]) -> Any:
    vision = config.get("vision_config") or {}
    return vision.get("hidden_size", vision.get("vt_hidden_size", 1152))


def _equal_to_tower(value: Any, config: Mapping[str, Any]) -> tuple[str, str] | None:
    width = _vision_width(config)
    if value is None or value == width:
        return None
    return (
        f"the projector normalizes the tower's {width}-wide outputs",
        f"set it to vision_config's hidden_size ({width})",
    )


KIMI_K25_KEYS = KeyTable(
    "kimi_k25",
    (
        mapped("text_config", "the decoder's args (checked by deepseek_v3's table)"),
        mapped("vision_config", "vision (MoonViTArgs; its keys: docs/vlm.md)"),
        mapped("image_token_id", "image_token_id (the placeholder the tower's tokens replace)"),
        mapped("media_placeholder_token_id", "image_token_id (the remote-code name)"),
        mapped("video_token_id", "video_token_id (kept for export; videos are not trained yet)"),
        mapped("vision_start_token_id", "vision_start_token_id"),
        mapped("vision_end_token_id", "vision_end_token_id"),
        mapped("tie_word_embeddings", "tie_word_embeddings (the top level's wins; default true)"),
        mapped("projection_hidden_size", "vision.dim (the projector's norm)", _equal_to_tower),
        mapped("projection_layer_norm_eps", "vision.projection_eps"),
        irrelevant("use_unified_vision_chunk", "video chunking of the remote-code processor"),
        irrelevant("video_placeholder", "the remote-code processor's video token text"),
    ),
)
"""Kimi K2.5's top-level ``config.json`` keys."""
