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
        """Our args for ``config`` (its keys checked first, unknown ones logged as warnings)."""
        for warning in self.check_keys(config):
            logger.warning(warning)
        kwargs = {f.ours: f.read(config) for f in self.fields if f.ours is not None}
        for section in self.sections:
            kwargs.update(section.from_hf(config))
        args = self.make_args(**kwargs)
        if self.check is not None:
            self.check(args, config)
        return args
