"""The ``hf`` family's args: one local transformers ``config.json`` (docs/hf_models.md).

``model.flavor`` is the path of a Hugging Face folder (holding ``config.json``, and weights
when ``checkpoint.initial_load_in_hf`` loads them) or of a ``config.json`` itself:
:class:`HFFlavors` reads it on lookup, so config validation refuses a bad file before any
process group exists, as one line naming the file and the rule.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping
from functools import cached_property
from pathlib import Path
from typing import Any

from torchtitan.config.errors import ConfigError
from torchtitan.models.hf.model import meta_model
from torchtitan.tools.logging import logger

FIELD = "model.flavor"
TRUST_FIELD = "model.hf_trust_remote_code"


class TrustedPath(str):
    """A flavor key (the path) that opts into the folder's remote code: what
    ``model.hf_trust_remote_code`` turns ``model.flavor`` into (:func:`flavor_key`)."""


def flavor_key(flavor: str, trust_remote_code: bool) -> str:
    """The ``flavors`` key of ``flavor``: a :class:`TrustedPath` when the user opted in."""
    return TrustedPath(flavor) if trust_remote_code else flavor


@dataclasses.dataclass(frozen=True)
class HFArgs:
    """A transformers causal LM's shape, read from its ``config.json`` (``hf_config``); the
    trainer replaces ``vocab_size`` (the tokenizer's) and ``max_seq_len``."""

    path: str
    """The folder or ``config.json`` (``model.flavor``)."""
    hf_config: Mapping[str, Any] = dataclasses.field(repr=False, compare=False, hash=False)
    """The file's contents, as read and checked (:func:`read_hf_config`)."""
    n_layers: int = 0
    vocab_size: int = 0
    max_seq_len: int = 2048
    """``num_hidden_layers``, ``vocab_size``, ``max_position_embeddings`` (read through a
    ``text_config`` where the file nests one, as the other shape fields)."""
    dim: int = 0
    """``hidden_size`` (or ``d_model``)."""
    n_heads: int = 0
    n_kv_heads: int = 0
    """``num_attention_heads``; ``num_key_value_heads``, defaulting to the former."""
    head_dim_: int = 0
    """``head_dim``, defaulting to ``dim // n_heads`` (read as the :attr:`head_dim` property)."""
    intermediate_size: int = 0
    tie_word_embeddings: bool = False
    trust_remote_code: bool = False
    """Build the folder's own code (``auto_map``): the user opted in and the file names some."""

    @property
    def head_dim(self) -> int:
        return self.head_dim_

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads

    @property
    def hidden_dim(self) -> int:
        return self.intermediate_size

    def num_params(self, exclude_embedding: bool = False, active: bool = False) -> int:
        """Parameters of the model built on ``meta`` (exact for any architecture), less the
        embedding matrix with ``exclude_embedding``. ``active`` counts every expert of a
        mixture too: the generic family does not know its routing (docs/hf_models.md)."""
        n = sum(p.numel() for p in meta_model(self).parameters())
        return n - self.vocab_size * self.dim if exclude_embedding else n

    @cached_property
    def config(self) -> Any:
        """The transformers ``PretrainedConfig`` this run builds: the file's, with our
        vocabulary, and token ids outside it dropped."""
        from transformers import AutoConfig

        raw = dict(self.hf_config)
        model_type = raw.pop("model_type")
        remote = self.trust_remote_code and "auto_map" in raw
        for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
            if isinstance(raw.get(key), int) and raw[key] >= self.vocab_size:
                raw[key] = None
        raw["vocab_size"] = self.vocab_size
        raw["max_position_embeddings"] = max(
            int(raw.get("max_position_embeddings") or 0), self.max_seq_len
        )
        raw["use_cache"] = False
        if remote:  # the folder's configuration class (read_hf_config logged the risk)
            folder = Path(self.path) if Path(self.path).is_dir() else Path(self.path).parent
            keys = ("pad_token_id", "bos_token_id", "eos_token_id", "vocab_size")
            overrides = {k: raw[k] for k in (*keys, "max_position_embeddings", "use_cache")}
            return AutoConfig.from_pretrained(folder, trust_remote_code=True, **overrides)
        return AutoConfig.for_model(model_type, **raw)


def _config_file(path: str) -> Path:
    p = Path(path)
    file = p / "config.json" if p.is_dir() else p
    if not file.is_file():
        raise ConfigError(
            FIELD,
            path,
            "the hf family reads a Hugging Face folder holding config.json, or a config.json, "
            "and there is none there",
            "pass a local folder saved by transformers' save_pretrained, or its config.json",
        )
    return file


def read_hf_config(path: str, trust_remote_code: bool = False) -> dict[str, Any]:
    """The ``config.json`` at ``path`` (a folder or the file), checked: valid JSON, a
    ``model_type`` transformers knows as a causal LM, and no remote code unless
    ``trust_remote_code`` (then one warning names the risk)."""
    file = _config_file(path)
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(FIELD, path, f"{file} is not valid JSON ({e})", "fix the file") from e
    if not isinstance(config, dict):
        raise ConfigError(FIELD, path, f"{file} is not a JSON object", "fix the file")
    if "auto_map" in config:
        return _remote_code_config(path, file, config, trust_remote_code)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = config.get("model_type")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        arch = config.get("architectures")
        raise ConfigError(
            FIELD,
            path,
            f"{file} has model_type {model_type!r} (architectures {arch}), which this "
            "transformers does not know as a causal LM",
            "upgrade transformers, or use a folder of a supported architecture",
        )
    return config


def _remote_code_config(
    path: str, file: Path, config: dict[str, Any], trust_remote_code: bool
) -> dict[str, Any]:
    """A config naming remote code: refused without the opt-in; with it, one warning."""
    if not trust_remote_code:
        raise ConfigError(
            FIELD,
            path,
            f"{file} names remote code (auto_map): building it runs Python files from the "
            "folder with this process's rights, which can do anything on this machine",
            f"set {TRUST_FIELD} = true if you have read or trust that code, or use a model "
            "transformers implements itself (no auto_map)",
        )
    if "AutoModelForCausalLM" not in config["auto_map"]:
        raise ConfigError(
            FIELD,
            path,
            f"{file}'s auto_map names no AutoModelForCausalLM ({sorted(config['auto_map'])})",
            "use a folder whose remote code is a causal LM",
        )
    logger.warning(
        f"{TRUST_FIELD}: building {path} runs the Python files of its folder (auto_map) with "
        "this process's rights; they can read, write and send anything this process can"
    )
    return config


def args_from_config(path: str, config: Mapping[str, Any]) -> HFArgs:
    """The shape fields of an (already checked) HF config dict; nested text configs (Gemma 3's
    multimodal wrapper) are read through their ``text_config``."""
    text = config.get("text_config") or config
    dim = int(text.get("hidden_size") or text.get("d_model") or 0)
    heads = int(text.get("num_attention_heads") or 0)
    return HFArgs(
        path=path,
        hf_config=dict(config),
        n_layers=int(text.get("num_hidden_layers") or 0),
        vocab_size=int(text.get("vocab_size") or 0),
        max_seq_len=int(text.get("max_position_embeddings") or 2048),
        dim=dim,
        n_heads=heads,
        n_kv_heads=int(text.get("num_key_value_heads") or heads),
        head_dim_=int(text.get("head_dim") or (dim // heads if heads else 0)),
        intermediate_size=int(text.get("intermediate_size") or 0),
        tie_word_embeddings=bool(
            config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        ),
        trust_remote_code=isinstance(path, TrustedPath) and "auto_map" in config,
    )


class HFFlavors(Mapping[str, HFArgs]):
    """``model.flavor`` -> args: any path to a local HF folder or ``config.json`` is a flavor
    (read on lookup; a bad one raises :class:`ConfigError`); a :class:`TrustedPath` key
    opts into remote code. Lists the paths looked up so far."""

    def __init__(self) -> None:
        self._seen: dict[tuple[str, bool], HFArgs] = {}

    def __getitem__(self, path: str) -> HFArgs:
        trusted = isinstance(path, TrustedPath)
        key = (str(path), trusted)
        if key not in self._seen:
            self._seen[key] = args_from_config(path, read_hf_config(str(path), trusted))
        return self._seen[key]

    def __contains__(self, path: object) -> bool:
        if not isinstance(path, str):
            return False
        self[path]  # raises the ConfigError that says what is wrong with it
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(dict.fromkeys(p for p, _ in self._seen))

    def __len__(self) -> int:
        return len(self._seen)
