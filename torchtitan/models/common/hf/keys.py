"""Every ``config.json`` key a family knows, and what we do with it (docs/hf_io.md, "Config keys").

A family declares one :class:`KeyTable` in its folder (``models/<family>/hf_keys.py``): each key
is *mapped* (to the args fields named), *refused* (with the reason; a value the family computes
anyway, such as ``attention_dropout: 0``, is accepted) or *irrelevant* to training (inference
switches, bookkeeping). :func:`check_hf_config` runs the table over a ``config.json`` wherever one
is read (``HFConfig.args_from_hf``: the converter, evaluation; the trainer's preflight for
``checkpoint.initial_load_in_hf``): an unknown key is a warning naming it, a known key holding a
value we cannot compute is an :class:`HFConfigError` (one line, exit 2) naming the key, the value
and what we support. Nothing is ignored silently.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from torchtitan.config.errors import ConfigError

Rule = Callable[[Any, Mapping[str, Any]], "tuple[str, str] | None"]
"""``(value, whole config) -> (rule, fix)`` when the value is not supported, else None."""

MAPPED, REFUSED, IRRELEVANT = "mapped", "refused", "irrelevant"


class HFConfigError(ConfigError):
    """A ``config.json`` key holds a value the family cannot compute exactly."""


@dataclass(frozen=True)
class HFKey:
    """One ``config.json`` key: its status, our fields or the reason, and the values refused."""

    key: str
    status: str
    note: str
    """Mapped: our args fields; refused / irrelevant: why."""
    rule: Rule | None = None


def mapped(key: str, ours: str, rule: Rule | None = None) -> HFKey:
    return HFKey(key, MAPPED, ours, rule)


def irrelevant(key: str, why: str) -> HFKey:
    return HFKey(key, IRRELEVANT, why)


def refused(
    key: str, why: str, accept: Callable[[Any], bool] = lambda v: v in (None, False)
) -> HFKey:
    """A key we cannot honour; values ``accept`` holds true for (what we compute anyway) pass."""

    def rule(value: Any, config: Mapping[str, Any]) -> tuple[str, str] | None:
        return None if accept(value) else (why, f"remove {key} or set it to what we compute")

    return HFKey(key, REFUSED, why, rule)


def only(*allowed: Any, what: str = "") -> Rule:
    """A rule accepting only ``allowed`` values (``what`` explains them)."""

    def rule(value: Any, config: Mapping[str, Any]) -> tuple[str, str] | None:
        if value in allowed:
            return None
        shown = ", ".join(repr(a) for a in allowed)
        return f"supported: {shown}{' (' + what + ')' if what else ''}", f"use {shown}"

    rule.shown = ", ".join(repr(a) for a in allowed)  # type: ignore[attr-defined]
    return rule


COMMON: tuple[HFKey, ...] = (
    mapped("model_type", "the family (models/__init__.py: family_for_hf_config)"),
    irrelevant("architectures", "the transformers class; the family comes from model_type"),
    irrelevant("transformers_version", "bookkeeping"),
    irrelevant("torch_dtype", "the stored dtype; tensors are read in their own dtype"),
    irrelevant("dtype", "the stored dtype; tensors are read in their own dtype"),
    irrelevant("use_cache", "an inference switch; generation always caches"),
    irrelevant("bos_token_id", "the tokenizer's (tokenizer_config.json)"),
    irrelevant("eos_token_id", "the tokenizer's (tokenizer_config.json)"),
    irrelevant("pad_token_id", "the tokenizer's; labels -100 mask padding"),
    irrelevant("initializer_range", "random init only; imported weights are loaded"),
    irrelevant("output_router_logits", "an inference output switch"),
    irrelevant("output_attentions", "an inference output switch"),
    irrelevant("output_hidden_states", "an inference output switch"),
    irrelevant("return_dict", "an inference output switch"),
    irrelevant("_name_or_path", "bookkeeping"),
    irrelevant("id2label", "sequence-classification heads only"),
    irrelevant("label2id", "sequence-classification heads only"),
    irrelevant("problem_type", "sequence-classification heads only"),
    irrelevant("chunk_size_feed_forward", "a transformers memory option (same result)"),
    irrelevant("is_encoder_decoder", "False for every decoder-only family"),
    irrelevant("auto_map", "remote-code class names; no code from a folder is run"),
    irrelevant("tokenizer_class", "the tokenizer's (tokenizer.json)"),
    irrelevant(
        "use_bfloat16", "a transformers 4 storage flag; tensors are read in their own dtype"
    ),
    irrelevant("torchscript", "a transformers export switch"),
    refused(
        "quantization_config",
        "quantized weights (GPTQ, AWQ, FP8, MXFP4...) are not read; dequantize to bf16 first",
    ),
    refused(
        "attention_dropout",
        "attention dropout is not implemented (training is deterministic)",
        lambda v: not v,
    ),
)
"""Keys every family shares."""


class KeyTable:
    """A family's keys (``COMMON`` plus its own, which override a common entry)."""

    def __init__(self, family: str, keys: Iterable[HFKey]) -> None:
        self.family = family
        self.keys: dict[str, HFKey] = {k.key: k for k in COMMON}
        self.keys.update({k.key: k for k in keys})

    def check(self, config: Mapping[str, Any], where: str = "config.json") -> list[str]:
        """Raises :class:`HFConfigError` on the first refused value; returns one warning per
        unknown key."""
        warnings = []
        for key, value in config.items():
            entry = self.keys.get(key)
            if entry is None:
                warnings.append(
                    f"{where}: key {key!r} is unknown to {self.family}'s Hugging Face mapping "
                    f"(docs/hf_io.md, 'Config keys'); it has no effect on the imported model"
                )
                continue
            problem = None if entry.rule is None else entry.rule(value, config)
            if problem is not None:
                raise HFConfigError(
                    f"{where}: {key}", value, f"{self.family}: {problem[0]}", problem[1]
                )
        return warnings

    def markdown(self) -> list[str]:
        """The table as Markdown rows (docs/hf_io.md)."""
        rows = ["| key | status | ours / reason |", "|---|---|---|"]
        for key in sorted(self.keys):
            k = self.keys[key]
            shown = getattr(k.rule, "shown", None)
            note = k.note + (f"; only {shown}" if shown else "")
            rows.append(f"| `{key}` | {k.status} | {note.replace('|', '/')} |")
        return rows
