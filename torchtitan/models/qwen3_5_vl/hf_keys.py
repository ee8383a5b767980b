"""The top-level keys of a multimodal Qwen3.5 ``config.json`` (``qwen3_5``, ``qwen3_5_moe``)
and what ``qwen3_5_vl`` does with them (``models/common/hf/keys.py``; generated into
docs/hf_io.md, "Config keys"). ``text_config`` is checked by Qwen3.5's table
(``models/qwen3_5/hf_keys.py``), ``vision_config`` by ``hf.py: vision_from_hf``."""

from __future__ import annotations

from torchtitan.models.common.hf.keys import KeyTable, mapped

QWEN35_VL_KEYS = KeyTable(
    "qwen3_5_vl",
    (
        mapped("text_config", "the decoder's args (checked by qwen3_5's table) and mrope_section"),
        mapped("vision_config", "vision (VisionArgs; its keys: docs/vlm.md)"),
        mapped("image_token_id", "image_token_id (the placeholder the tower's tokens replace)"),
        mapped("video_token_id", "video_token_id (kept for export; videos are not trained yet)"),
        mapped("vision_start_token_id", "vision_start_token_id (data: docs/vlm.md)"),
        mapped("vision_end_token_id", "vision_end_token_id (data: docs/vlm.md)"),
        mapped("tie_word_embeddings", "tie_word_embeddings (the top level's wins)"),
    ),
)
"""Qwen3.5-with-vision's top-level ``config.json`` keys."""
