"""Kimi K2.5 <-> ``Kimi_K25ForConditionalGeneration`` (docs/vlm.md, "Kimi K2.5"; docs/hf_io.md):

- the decoder: DeepSeek-V3's mapping (``models/deepseek_v3/hf.py``) under
  ``language_model.model.`` (the head ``language_model.lm_head``), the layout of the published
  checkpoints, which transformers converts when it loads them;
- the tower and the projector: ``vision_tower.*`` and ``mm_projector.*`` as they are (our
  names are the checkpoints': fused ``wqkv`` with RoPE on adjacent channel pairs, ``norm0``,
  ``mlp.fc0``, ``proj.0``...);
- read too, the spellings transformers' ``save_pretrained`` writes: decoder blocks under
  ``language_model.model.blocks.``, ``vision_tower.encoder.patch_embed.`` and
  ``model.mm_projector.pre_norm.``;
- ``config.json``: transformers' (``vision_config`` with ``hidden_size``, ``pos_emb_*``...) or
  the remote-code one (``vt_hidden_size``, ``init_pos_emb_*``, ``media_placeholder_token_id``);
  ``text_config`` by DeepSeek-V3's table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from torchtitan.config.errors import ConfigError
from torchtitan.models.common.hf import HFConfig, StateDictAdapter
from torchtitan.models.common.hf.mapping import Box, HFSource
from torchtitan.models.common.vision.moonvit import MoonViTArgs
from torchtitan.models.deepseek_v3.hf import DEEPSEEK_V3_HF
from torchtitan.models.kimi_k25.args import KimiK25Args
from torchtitan.models.kimi_k25.hf_keys import KIMI_K25_KEYS
from torchtitan.tools.logging import logger

VISUAL = ("vision_tower.", "mm_projector.")
TEXT = "language_model.model."
SPELLINGS = {
    "language_model.model.blocks.": "language_model.model.layers.",
    "vision_tower.encoder.patch_embed.": "vision_tower.patch_embed.",
    "model.mm_projector.": "mm_projector.",
}
"""transformers' ``save_pretrained`` spelling -> the one we write (and read)."""

VISION_FIELDS = {
    "num_hidden_layers": "depth",
    "hidden_size": "dim",
    "num_attention_heads": "n_heads",
    "intermediate_size": "intermediate_size",
    "patch_size": "patch_size",
    "pos_emb_height": "pos_emb_height",
    "pos_emb_width": "pos_emb_width",
    "pos_emb_time": "pos_emb_time",
    "hidden_act": "hidden_act",
}
REMOTE_FIELDS = {
    "vt_num_hidden_layers": "depth",
    "vt_hidden_size": "dim",
    "vt_num_attention_heads": "n_heads",
    "vt_intermediate_size": "intermediate_size",
    "init_pos_emb_height": "pos_emb_height",
    "init_pos_emb_width": "pos_emb_width",
    "init_pos_emb_time": "pos_emb_time",
    "projector_ln_eps": "projection_eps",
}
"""The remote-code ``vision_config`` names of the same fields."""
REMOTE_FIXED = {
    "merge_type": "sd2_tpool",
    "mm_projector_type": "patchmerger",
    "projector_hidden_act": "gelu",
    "video_attn_type": "spatial_temporal",
    "pos_emb_type": "divided_fixed",
}
"""Remote-code switches: the one value each that MoonViT (and transformers) computes."""
VISION_IGNORED = ("model_type", "initializer_range", "dtype", "torch_dtype", "architectures")
TOKEN_IDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def _refuse(key: str, value: Any, rule: str, fix: str) -> ConfigError:
    return ConfigError(f"vision_config.{key}", value, rule, fix)


def vision_from_hf(config: Mapping[str, Any], text_dim: int, eps: float) -> MoonViTArgs:
    """``vision_config`` -> :class:`MoonViTArgs` (the projector's width from the decoder); a key
    we would ignore is refused, and so is a value the tower does not compute."""
    fields: dict[str, Any] = {"out_dim": text_dim, "projection_eps": eps}
    for key, value in config.items():
        if key in VISION_FIELDS or key in REMOTE_FIELDS:
            fields[VISION_FIELDS.get(key) or REMOTE_FIELDS[key]] = value
        elif key == "merge_kernel_size":
            fields["merge_kernel"] = tuple(value)
        elif key == "rope_parameters":
            if (value or {}).get("rope_type", "axial") != "axial":
                raise _refuse(key, value, "MoonViT's 2D RoPE is axial", "use rope_type axial")
            fields["rope_theta"] = float(value.get("rope_theta") or 10_000.0)
        elif key in REMOTE_FIXED:
            if value != REMOTE_FIXED[key]:
                raise _refuse(key, value, f"supported: {REMOTE_FIXED[key]!r}", "use that value")
        elif key not in (*VISION_IGNORED, "mm_hidden_size", "text_hidden_size"):
            raise _refuse(key, value, "is not read by the MoonViT tower", "remove it")
    vision = MoonViTArgs(**fields)
    mm = config.get("mm_hidden_size", vision.dim)
    if mm != vision.dim or config.get("text_hidden_size", text_dim) != text_dim:
        raise _refuse(
            "mm_hidden_size",
            (mm, config.get("text_hidden_size")),
            f"must equal the tower's width {vision.dim} and the decoder's {text_dim}",
            "fix mm_hidden_size / text_hidden_size",
        )
    return vision


def vision_to_hf(v: MoonViTArgs) -> dict[str, Any]:
    out: dict[str, Any] = {hf: getattr(v, ours) for hf, ours in VISION_FIELDS.items()}
    out["merge_kernel_size"] = list(v.merge_kernel)
    out["model_type"] = "kimi_k25_vision"
    out["rope_parameters"] = {"rope_type": "axial", "rope_theta": v.rope_theta}
    return out


@dataclasses.dataclass(frozen=True)
class KimiK25HFConfig(HFConfig):
    """The multimodal ``config.json`` <-> :class:`KimiK25Args`."""

    def to_hf(self, args: Any, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        text = DEEPSEEK_V3_HF.config.to_hf(args, dtype)
        text.pop("architectures", None)
        text["num_nextn_predict_layers"] = 0
        return {
            "architectures": ["Kimi_K25ForConditionalGeneration"],
            "model_type": "kimi_k25",
            "text_config": text,
            "vision_config": vision_to_hf(args.vision),
            "projection_hidden_size": args.vision.dim,
            "projection_layer_norm_eps": args.vision.projection_eps,
            "tie_word_embeddings": args.tie_word_embeddings,
            **{key: getattr(args, key) for key in TOKEN_IDS},
            self.dtype_key: str(dtype).removeprefix("torch."),
        }

    def _text(self, config: Mapping[str, Any]) -> dict[str, Any]:
        # the published text_config says kimi_k2 (a DeepSeek-V3 decoder; transformers reads
        # it as deepseek_v3); the top level's tie_word_embeddings governs (transformers'
        # default: true)
        text = {**config["text_config"], "model_type": "deepseek_v3"}
        text["tie_word_embeddings"] = bool(config.get("tie_word_embeddings", True))
        return text

    def check_keys(self, config: Mapping[str, Any]) -> list[str]:
        """The top level against :data:`KIMI_K25_KEYS`, ``text_config`` against DeepSeek-V3's."""
        top = KIMI_K25_KEYS.check(config)
        text = config.get("text_config")
        return top + (DEEPSEEK_V3_HF.config.check_keys(self._text(config)) if text else [])

    def args_from_hf(self, config: Mapping[str, Any]) -> Any:
        if "text_config" not in config or "vision_config" not in config:
            raise ConfigError(
                "config.json",
                config.get("model_type"),
                "a Kimi K2.5 checkpoint needs text_config and vision_config",
                "use --model.name deepseek_v3 for a text-only DeepSeek-V3 / Kimi K2 checkpoint",
            )
        for warning in KIMI_K25_KEYS.check(config):
            logger.warning(warning)
        text = DEEPSEEK_V3_HF.config.args_from_hf(self._text(config))
        eps = float(config.get("projection_layer_norm_eps") or 1e-5)
        vision = vision_from_hf(config["vision_config"], text.dim, eps)
        ids = {key: config[key] for key in TOKEN_IDS if key in config}
        if "media_placeholder_token_id" in config:
            ids.setdefault("image_token_id", config["media_placeholder_token_id"])
        fields = {f.name: getattr(text, f.name) for f in dataclasses.fields(text)}
        return KimiK25Args(**{**fields, "mtp_depth": 0}, vision=vision, **ids)


KIMI_K25_HF = dataclasses.replace(
    DEEPSEEK_V3_HF,
    top={
        "tok_embeddings.weight": TEXT + "embed_tokens.weight",
        "norm.weight": TEXT + "norm.weight",
        "output.weight": "language_model.lm_head.weight",
    },
    layers=("layers", TEXT + "layers"),
    config=KimiK25HFConfig(make_args=KimiK25Args, constants={}, fields=(), keys=KIMI_K25_KEYS),
)
"""The decoder's names under ``language_model.``; the tower and the projector are
:class:`KimiK25Adapter`'s."""


def canonical(name: str) -> str:
    """An HF tensor name in the spelling we write (:data:`SPELLINGS`)."""
    for theirs, ours in SPELLINGS.items():
        if name.startswith(theirs):
            return ours + name.removeprefix(theirs)
    return name


def _spellings(name: str) -> list[str]:
    return [name] + [t + name.removeprefix(o) for t, o in SPELLINGS.items() if name.startswith(o)]


class _Spelled:
    """An :class:`HFSource` read by our spelling of its names (:data:`SPELLINGS`)."""

    def __init__(self, source: HFSource) -> None:
        self.source = source

    def _name(self, name: str) -> str:
        return next((n for n in _spellings(name) if n in self.source), name)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._name(name) in self.source

    def shape(self, name: str) -> tuple[int, ...]:
        return self.source.shape(self._name(name))

    def read(self, name: str, box: Box) -> torch.Tensor:
        return self.source.read(self._name(name), box)


class KimiK25Adapter(StateDictAdapter):
    """The shared adapter over :data:`KIMI_K25_HF` for the decoder; ``vision_tower.*`` and
    ``mm_projector.*`` as they are; transformers' spellings read too."""

    def to_hf_one(
        self, key: str, w: torch.Tensor, check: bool = True
    ) -> list[tuple[str, torch.Tensor]]:
        if key.startswith(VISUAL):
            return [(key, w)]
        return super().to_hf_one(key, w, check)

    def as_exported(self, name: str) -> str:
        """An HF tensor name as our export spells it (the weight-folder check compares those:
        ``preflight/validate_weights.py``)."""
        return canonical(name)

    def from_hf(self, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        named = {canonical(k): w for k, w in hf.items()}
        visual = {k: w for k, w in named.items() if k.startswith(VISUAL)}
        text = {k: w for k, w in named.items() if not k.startswith(VISUAL)}
        return {**super().from_hf(text), **visual}

    def from_hf_box(
        self, key: str, shape: tuple[int, ...], box: Box, source: HFSource
    ) -> torch.Tensor:
        spelled = _Spelled(source)
        if key.startswith(VISUAL):
            return spelled.read(key, box)
        return super().from_hf_box(key, shape, box, spelled)
