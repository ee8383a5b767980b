"""Model registry: family name -> ModelSpec, written out by hand (one line per family; see
docs/extending.md)."""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torchtitan.config.errors import ConfigError
from torchtitan.models.common.args import layer_override, mtp_overrides
from torchtitan.models.common.moe import moe_overrides
from torchtitan.models.deepseek_v3 import deepseek_v3_spec
from torchtitan.models.gpt_oss import gpt_oss_spec
from torchtitan.models.hf import hf_spec
from torchtitan.models.kimi_k25 import kimi_k25_spec
from torchtitan.models.llama3 import llama3_spec
from torchtitan.models.qwen3 import qwen3_spec
from torchtitan.models.qwen3_5 import qwen3_5_spec
from torchtitan.models.qwen3_5_vl import qwen3_5_vl_spec
from torchtitan.models.spec import ModelSpec, runtime_args

MODELS: dict[str, ModelSpec] = {
    "llama3": llama3_spec,
    "qwen3": qwen3_spec,
    "qwen3_5": qwen3_5_spec,
    "qwen3_5_vl": qwen3_5_vl_spec,  # Qwen3.5 with vision (docs/vlm.md)
    "gpt_oss": gpt_oss_spec,
    "deepseek_v3": deepseek_v3_spec,
    "kimi_k25": kimi_k25_spec,  # DeepSeek-V3 decoder + MoonViT (docs/vlm.md)
    "hf": hf_spec,  # any transformers causal LM from a local folder (docs/hf_models.md)
}


def family_for_hf_config(config: Mapping[str, Any]) -> tuple[str, Any]:
    """(our family name, its args) for a transformers ``config.json``, by its ``model_type``
    (each family declares the ones it reads: ``FamilySpec.hf_model_types``)."""
    model_type = config.get("model_type", "llama")  # old Llama configs may lack it
    known: list[str] = []
    for name, spec in MODELS.items():
        types = getattr(spec, "hf_model_types", ())
        known += types
        if model_type in types:
            return name, spec.hf.config.args_from_hf(config)  # type: ignore[attr-defined]
    raise ValueError(f"config.json: model_type {model_type!r} is not one of {known}")


def model_title(cfg: Any) -> str:
    """The family and flavor a config builds (``qwen3 30B-A3B``), with its adapters: what
    banners name (a config's ``job.description`` is the user's free text and may describe
    another model, e.g. ``debug_model.toml`` run with ``--model.name qwen3``)."""
    title = f"{cfg.model.name} {cfg.model.flavor}"
    if cfg.lora.enable:
        nf4 = " on an NF4 base" if cfg.lora.quantize_base == "nf4" else ""
        title += f" + LoRA rank {cfg.lora.rank}{nf4}"
    return title


def check_hf_config(family: str, config: Mapping[str, Any]) -> list[str]:
    """Every key of a transformers ``config.json`` against ``family``'s key table
    (``models/<family>/hf_keys.py``; docs/hf_io.md, "Config keys"): raises ``HFConfigError`` (a
    ``ConfigError``: one line, exit 2) naming the first key whose value we cannot compute, the
    value and what is supported; returns one warning per unknown key. ``args_from_hf`` runs it
    on every import; call it where a folder's ``config.json`` is read without importing args."""
    hf = getattr(MODELS[family], "hf", None)
    return [] if hf is None else list(hf.config.check_keys(config))


HONOURED_FIELDS = (
    "rope_theta",
    "rope_scaling",
    "yarn",
    "rope_factor",
    "rope_original_max_seq_len",
    "rope_beta_fast",
    "rope_beta_slow",
    "rope_mscale",
    "rope_mscale_all_dim",
    "sliding_window",
    "window_layers",
    "layer_types",
    "tie_word_embeddings",
    "norm_eps",
)
"""The args fields a ``config.json`` sets beyond the shapes (RoPE, attention windows, the tied
head, the norm epsilon): a run that starts from the folder takes them from it
(:func:`hf_folder_settings`); its shapes stay the flavor's."""


def hf_folder_settings(cfg: Any) -> dict[str, Any]:
    """What a run that starts from a Hugging Face folder (``checkpoint.initial_load_in_hf``)
    takes from its ``config.json`` beyond the shapes: the :data:`HONOURED_FIELDS` (RoPE
    scaling, attention windows, the tied head, ``rope_theta``, the norm epsilon), so a Qwen3
    folder with YaRN or a sliding window trains as that model (docs/hf_io.md, "Config keys"),
    and the fields its args name in ``HF_FOLDER_FIELDS`` (``qwen3_5_vl``: the image token ids
    and the MRoPE split, so the model and the data, both built from :func:`run_args`, take the
    folder's ids; docs/vlm.md). Empty without such a folder, or when its ``config.json`` is unreadable or of another family
    (the preflight names those: ``preflight/validate_weights.py``). The shapes stay the
    flavor's, checked against the folder's by the preflight. Read once per file version (the
    preflight asks from several checks; an unknown key is warned about once)."""
    ck = cfg.checkpoint
    if not (ck.initial_load_in_hf and ck.initial_load_path):
        return {}
    path = Path(ck.initial_load_path) / "config.json"
    try:
        stamp = path.stat().st_mtime_ns
    except OSError:
        return {}
    return dict(_folder_settings(cfg.model.name, flavor_of(cfg), str(path), stamp))


@functools.lru_cache(maxsize=16)
def _folder_settings(
    family: str, flavor_key: str, path: str, stamp: int
) -> tuple[tuple[str, Any], ...]:
    spec: Any = MODELS.get(family)
    hf = getattr(spec, "hf", None)
    flavor = spec.flavors[flavor_key] if spec is not None else None
    # a family may start from model types it does not claim (qwen3_5_vl: the multimodal
    # checkpoints family_for_hf_config gives to qwen3_5), and take more fields (its args' own)
    types = getattr(spec, "hf_model_types", ()) or getattr(flavor, "HF_FOLDER_TYPES", ())
    if hf is None or not types:
        return ()
    try:
        config = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return ()
    if not isinstance(config, dict) or config.get("model_type", "llama") not in types:
        return ()
    try:
        theirs = hf.config.args_from_hf(config)
    except ConfigError:  # a value we cannot compute: one line, exit 2
        raise
    except (KeyError, TypeError, ValueError):
        return ()
    fields = HONOURED_FIELDS + tuple(getattr(flavor, "HF_FOLDER_FIELDS", ()))
    names = [n for n in fields if hasattr(flavor, n) and hasattr(theirs, n)]
    return tuple((n, getattr(theirs, n)) for n in names if getattr(theirs, n) != getattr(flavor, n))


def flavor_of(cfg: Any) -> str:
    """The key ``model.flavor`` looks up in its family's ``flavors``: a family with a
    ``flavor_key`` (the hf family: it carries ``model.hf_trust_remote_code``) builds it from
    the model section, the others take ``model.flavor`` as it is."""
    key = getattr(MODELS.get(cfg.model.name), "flavor_key", None)
    return key(cfg.model) if callable(key) else cfg.model.flavor  # type: ignore[no-any-return]


def flavor_args(cfg: Any) -> Any:
    """The flavor's args with a Hugging Face folder's settings (:func:`hf_folder_settings`)
    and ``model.n_layers`` / ``model.moe_*``: what the preflight's model checks read (the runtime sizes are :func:`run_args`')."""
    args = MODELS[cfg.model.name].flavors[flavor_of(cfg)]
    settings = hf_folder_settings(cfg)
    args = dataclasses.replace(args, **settings) if settings else args
    return moe_overrides(layer_override(args, cfg.model), cfg.model)


def run_args(cfg: Any, vocab_size: int, attn_backend: str | None = None) -> Any:
    """The args a run builds, one home for the trainer, the preflight, the estimator and the
    planner: the flavor with the tokenizer's vocabulary and ``training.seq_len``
    (:func:`runtime_args`), a Hugging Face folder's settings, then ``model.n_layers`` and the
    ``model.moe_*`` and ``model.mtp_*`` overrides."""
    spec = MODELS[cfg.model.name]
    args = runtime_args(spec, flavor_of(cfg), vocab_size, cfg.training.seq_len, attn_backend)
    settings = hf_folder_settings(cfg)
    if settings:
        args = dataclasses.replace(args, **settings)
    args = layer_override(args, cfg.model)
    return mtp_overrides(moe_overrides(args, cfg.model), cfg.model)


__all__ = [
    "MODELS",
    "ModelSpec",
    "check_hf_config",
    "family_for_hf_config",
    "flavor_args",
    "flavor_of",
    "hf_folder_settings",
    "model_title",
    "run_args",
    "runtime_args",
]
