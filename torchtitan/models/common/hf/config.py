"""A family's ``config.json`` translation, declared as data (docs/extending.md, section 5).

:class:`HFConfig` lists the fields that map one-to-one (an HF key, the args field it sets, the
args attribute it is exported from, the default when a ``config.json`` lacks it), the constants
written as they are, and sections for what is nested or conditional (RoPE scaling, MoE).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from torchtitan.models.common.hf.keys import KeyTable
from torchtitan.tools.logging import logger

REQUIRED: Any = object()
"""The default of a field every ``config.json`` must hold."""


@dataclass(frozen=True)
class ConfigField:
    """One ``config.json`` key <-> one of our args."""

    hf: str
    ours: str | None
    """The args field it sets on import; None: exported only."""
    export: str | None = None
    """The args attribute exported (default ``ours``)."""
    default: Any = REQUIRED
    """On import when the key is absent; a callable gets the whole config."""

    def value(self, args: Any) -> Any:
        name = self.export or self.ours
        assert name is not None, self
        return getattr(args, name)

    def read(self, config: Mapping[str, Any]) -> Any:
        if self.hf in config or self.default is REQUIRED:
            return config[self.hf]
        return self.default(config) if callable(self.default) else self.default


class ConfigSection(Protocol):
    """A nested or conditional part of ``config.json`` (RoPE scaling, MoE)."""

    def to_hf(self, args: Any) -> dict[str, Any]:
        """Keys to add to (or replace in) the exported config."""
        ...

    def from_hf(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """Our args fields read from ``config``."""
        ...


@dataclass(frozen=True)
class HFConfig:
    """Our args <-> a transformers ``config.json`` dict."""

    make_args: Callable[..., Any]
    """The family's args class."""
    constants: Mapping[str, Any]
    """Written as they are (``architectures``, ``model_type``, ``hidden_act``...)."""
    fields: tuple[ConfigField, ...]
    sections: tuple[ConfigSection, ...] = ()
    check: Callable[[Any, Mapping[str, Any]], None] | None = None
    """Raises when the args read cannot express ``config`` exactly."""
    dtype_key: str = field(default="torch_dtype")
    keys: KeyTable | None = None
    """Every ``config.json`` key the family knows (``models/<family>/hf_keys.py``), checked on
    every import (``keys.py``)."""

    def to_hf(self, args: Any, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        config: dict[str, Any] = dict(self.constants)
        config.update({f.hf: f.value(args) for f in self.fields})
        config[self.dtype_key] = str(dtype).removeprefix("torch.")
        for section in self.sections:
            config.update(section.to_hf(args))
        return config

    def check_keys(self, config: Mapping[str, Any]) -> list[str]:
        """:meth:`KeyTable.check`: raises ``HFConfigError`` on a value we cannot compute,
        returns a warning per unknown key."""
        return [] if self.keys is None else self.keys.check(config)

    def args_from_hf(self, config: Mapping[str, Any]) -> Any:
        """Our args for ``config`` (its keys checked first, unknown ones logged as warnings).
        A key it leaves out means what transformers builds without it (:func:`absent_keys`),
        except the shapes every file must state (``REQUIRED`` fields: a ``KeyError``, which
        the entry points report as ``config.json lacks the key ...``)."""
        required = {f.hf for f in self.fields if f.default is REQUIRED}
        known = () if self.keys is None else tuple(k for k in self.keys.keys if k not in required)
        config = {**absent_keys(config, known), **config}
        for warning in self.check_keys(config):
            logger.warning(warning)
        kwargs = {f.ours: f.read(config) for f in self.fields if f.ours is not None}
        for section in self.sections:
            kwargs.update(section.from_hf(config))
        args = self.make_args(**kwargs)
        if self.check is not None:
            self.check(args, config)
        return args


def absent_keys(config: Mapping[str, Any], known: tuple[str, ...]) -> dict[str, Any]:
    """transformers' values of the ``known`` keys ``config`` leaves out: its config class built
    from ``config`` (class defaults, and what it derives, e.g. ``layer_types`` from the layer
    count). A hand-written ``config.json`` without ``routed_scaling_factor`` is a model routed
    at scale 2.5 in transformers; read as absent it would silently be another model. Empty when
    transformers cannot build the config (an unknown ``model_type``: the key table refuses it)."""
    if not known or all(k in config for k in known):
        return {}
    import transformers

    given = {k: v for k, v in config.items() if k != "model_type"}
    try:
        theirs = transformers.AutoConfig.for_model(str(config.get("model_type")), **given).to_dict()
    except Exception:  # transformers refuses the config itself: ours reports what is wrong
        return {}
    return {k: theirs[k] for k in known if k not in config and k in theirs}
