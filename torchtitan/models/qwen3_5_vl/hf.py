"""Qwen3.5 with vision <-> ``Qwen3_5ForConditionalGeneration`` /
``Qwen3_5MoeForConditionalGeneration`` (docs/vlm.md, docs/hf_io.md):

- the text decoder: Qwen3.5's mapping (``models/qwen3_5/hf.py``) under
  ``model.language_model.`` (``lm_head`` at the top);
- the vision tower: ``visual.X`` <-> ``model.visual.X``, the same names and layouts
  (``models/common/vision/tower.py``);
- ``config.json``: the multimodal config, its ``text_config`` read and written by Qwen3.5's
  text config (plus MRoPE's ``mrope_section``), its ``vision_config`` here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from torchtitan.config.errors import ConfigError
from torchtitan.models.common.hf import HFConfig, StateDictAdapter
from torchtitan.models.common.hf.mapping import Box, HFSource
from torchtitan.models.common.vision import VisionArgs
from torchtitan.models.qwen3_5.hf import QWEN35_HF
from torchtitan.models.qwen3_5_vl.args import Qwen35VLArgs
from torchtitan.models.qwen3_5_vl.hf_keys import QWEN35_VL_KEYS
from torchtitan.tools.logging import logger

VISUAL, HF_VISUAL = "visual.", "model.visual."
TEXT = "model.language_model."
MTP = "mtp."
"""The multi-token-prediction head of the published checkpoints: not read."""

# vision_config key -> VisionArgs field
VISION_FIELDS = {
    "depth": "depth",
    "hidden_size": "dim",
    "num_heads": "n_heads",
    "intermediate_size": "intermediate_size",
    "out_hidden_size": "out_dim",
    "in_channels": "in_channels",
    "patch_size": "patch_size",
    "temporal_patch_size": "temporal_patch_size",
    "spatial_merge_size": "spatial_merge_size",
    "num_position_embeddings": "num_position_embeddings",
    "hidden_act": "hidden_act",
}
VISION_IGNORED = ("model_type", "initializer_range", "dtype", "torch_dtype", "architectures")
TOKEN_IDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def vision_from_hf(config: Mapping[str, Any]) -> VisionArgs:
    """``vision_config`` -> :class:`VisionArgs`; a key we would ignore silently is refused
    (``deepstack_visual_indexes``: Qwen3-VL's, not Qwen3.5's) and a non-axial RoPE too."""
    for key, value in config.items():
        if key in VISION_FIELDS or key in VISION_IGNORED:
            continue
        if key == "rope_parameters" and (value or {}).get("rope_type", "axial") == "axial":
            continue
        if key == "deepstack_visual_indexes" and not value:
            continue
        raise ConfigError(
            f"vision_config.{key}",
            value,
            "is not read by the shared vision tower (Qwen3.5's: no deepstack, axial 2D RoPE)",
            "remove it, or use a checkpoint of the Qwen3.5 family",
        )
    theta = float(((config.get("rope_parameters") or {}).get("rope_theta")) or 10_000.0)
    kwargs = {ours: config[hf] for hf, ours in VISION_FIELDS.items() if hf in config}
    return VisionArgs(**kwargs, rope_theta=theta)


def vision_to_hf(v: VisionArgs, moe: bool) -> dict[str, Any]:
    out: dict[str, Any] = {hf: getattr(v, ours) for hf, ours in VISION_FIELDS.items()}
    out["model_type"] = "qwen3_5_moe_vision" if moe else "qwen3_5_vision"
    out["rope_parameters"] = {"rope_type": "axial", "rope_theta": v.rope_theta}
    return out


@dataclasses.dataclass(frozen=True)
class Qwen35VLHFConfig(HFConfig):
    """The multimodal ``config.json`` <-> :class:`Qwen35VLArgs`."""

    def to_hf(self, args: Any, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        text = QWEN35_HF.config.to_hf(args, dtype)
        moe = args.moe is not None
        text.pop("architectures", None)
        text["model_type"] = "qwen3_5_moe_text" if moe else "qwen3_5_text"
        text["rope_parameters"]["mrope_section"] = list(args.mrope_section)
        text["rope_parameters"]["mrope_interleaved"] = True
        top = "Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"
        return {
            "architectures": [top],
            "model_type": "qwen3_5_moe" if moe else "qwen3_5",
            "text_config": text,
            "vision_config": vision_to_hf(args.vision, moe),
            "tie_word_embeddings": args.tie_word_embeddings,
            **{key: getattr(args, key) for key in TOKEN_IDS},
            self.dtype_key: str(dtype).removeprefix("torch."),
        }

    def check_keys(self, config: Mapping[str, Any]) -> list[str]:
        """The top level against :data:`QWEN35_VL_KEYS`, ``text_config`` against Qwen3.5's."""
        top = QWEN35_VL_KEYS.check(config)
        return top + QWEN35_HF.config.check_keys(config.get("text_config", {}))

    def args_from_hf(self, config: Mapping[str, Any]) -> Any:
        if "text_config" not in config or "vision_config" not in config:
            raise ConfigError(
                "config.json",
                config.get("model_type"),
                "a vision-language checkpoint needs text_config and vision_config",
                "use --model.name qwen3_5 for a text-only Qwen3.5 checkpoint",
            )
        # the top level's tie_word_embeddings governs the multimodal model (text_config may
        # carry its own default)
        tie = config.get("tie_word_embeddings", config["text_config"].get("tie_word_embeddings"))
        text_config = {**config["text_config"], "tie_word_embeddings": bool(tie)}
        for warning in QWEN35_VL_KEYS.check(config):
            logger.warning(warning)
        text = QWEN35_HF.config.args_from_hf({**config, "text_config": text_config})
        rope = config["text_config"].get("rope_parameters") or {}
        fields = {f.name: getattr(text, f.name) for f in dataclasses.fields(text)}
        return Qwen35VLArgs(
            **fields,
            vision=vision_from_hf(config["vision_config"]),
            mrope_section=tuple(rope.get("mrope_section") or (11, 11, 10)),  # type: ignore[arg-type]
            **{key: config[key] for key in TOKEN_IDS if key in config},
        )


_TEXT_TOP = {
    "tok_embeddings.weight": TEXT + "embed_tokens.weight",
    "norm.weight": TEXT + "norm.weight",
    "output.weight": "lm_head.weight",
}

QWEN35_VL_HF = dataclasses.replace(
    QWEN35_HF,
    top=_TEXT_TOP,
    layers=("layers", TEXT + "layers"),
    config=Qwen35VLHFConfig(make_args=Qwen35VLArgs, constants={}, fields=(), keys=QWEN35_VL_KEYS),
)
"""The text decoder's names under ``model.language_model.``; the tower is
:class:`Qwen35VLStateDictAdapter`'s."""


class Qwen35VLStateDictAdapter(StateDictAdapter):
    """The shared adapter over :data:`QWEN35_VL_HF` for the decoder; ``visual.*`` as it is,
    under ``model.visual.``; ``mtp.*`` skipped."""

    def to_hf_one(
        self, key: str, w: torch.Tensor, check: bool = True
    ) -> list[tuple[str, torch.Tensor]]:
        if key.startswith(VISUAL):
            return [("model." + key, w)]
        return super().to_hf_one(key, w, check)

    def from_hf(self, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        visual = {k.removeprefix("model."): w for k, w in hf.items() if k.startswith(HF_VISUAL)}
        text = {k: w for k, w in hf.items() if not k.startswith((HF_VISUAL, MTP))}
        return {**super().from_hf(text), **visual}

    def from_hf_box(
        self, key: str, shape: tuple[int, ...], box: Box, source: HFSource
    ) -> torch.Tensor:
        if key.startswith(VISUAL):
            return source.read("model." + key, box)
        return super().from_hf_box(key, shape, box, source)
