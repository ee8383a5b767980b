"""Config files that compose: ``extends`` chains and several files on the command line.

A TOML file may name its base at the top level, ``extends = "base.toml"`` (a path relative to
the file); the base may extend another, and so on. Several files may be given on the command
line, ``--job.config_file a.toml --job.config_file b.toml`` or ``--job.config_file a.toml,b.toml``;
each expands to its chain, base first, and the layers apply in that order, so a later layer
overrides an earlier one field by field (an array of tables, ``[[training.mixture]]``, is
replaced whole). Precedence: defaults < each file's chain, in command-line order < the other
command-line overrides (docs/configs.md).

This module is pure: it takes the TOML loader and the section-applier from
``config/manager.py`` as arguments, so that manager can import it without a cycle.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from torchtitan.config.errors import ConfigError

EXTENDS = "extends"
"""The top-level key naming a file's base."""

DEFAULT = "default"
COMMAND_LINE = "command line"

Layer = tuple[str, dict[str, Any]]
"""(file as shown to the user, its TOML mapping without ``extends``)."""


def split_files(values: list[str | None]) -> list[str]:
    """Every ``--job.config_file`` value (given several times and/or as a comma list), in order."""
    return [p.strip() for v in values if v for p in v.split(",") if p.strip()]


def chain(path: str, load: Callable[[str], dict[str, Any]]) -> list[Layer]:
    """The layers of ``path``: its ``extends`` chain, base first, ``path`` last.

    A base that does not exist, an ``extends`` that is not a string, and a cycle are
    ConfigErrors naming the file that has the bad ``extends``.
    """
    layers: list[Layer] = []
    seen: list[str] = []
    current = path
    if "\x00" in path:  # no file has such a name (and os.path refuses it with a ValueError)
        raise ConfigError(
            "job.config_file", path, "must be an existing TOML file", "check the path"
        )
    while True:
        key = os.path.realpath(current)
        if key in seen:
            loop = " -> ".join([*(name for name, _ in layers), current])
            raise ConfigError(
                EXTENDS,
                None,
                f"the chain is a cycle ({loop})",
                "make one file in the chain extend nothing",
            )
        seen.append(key)
        mapping = dict(load(current))
        base = mapping.pop(EXTENDS, None)
        layers.append((current, mapping))
        if base is None:
            return layers[::-1]
        if not isinstance(base, str) or not base or "\x00" in base:
            raise ConfigError(
                EXTENDS, base, f"in {current}: must be a file path", 'write extends = "base.toml"'
            )
        nxt = os.path.normpath(os.path.join(os.path.dirname(current), base))
        if Path(nxt).is_dir():
            tomls = sorted(p.name for p in Path(nxt).glob("*.toml"))[:5]
            raise ConfigError(
                EXTENDS,
                base,
                f"in {current}: the base {nxt} is a folder, not a TOML file",
                f"name a TOML file in it (e.g. {', '.join(tomls)})"
                if tomls
                else "name a TOML file, relative to the file that extends it",
            )
        if not Path(nxt).is_file():
            raise ConfigError(
                EXTENDS,
                base,
                f"in {current}: the base file {nxt} does not exist",
                "give a path relative to the file that extends it",
            )
        current = nxt


def layers_of(files: list[str], load: Callable[[str], dict[str, Any]]) -> list[Layer]:
    """Every layer of every file, in the order they apply."""
    return [layer for f in files for layer in chain(f, load)]


def apply_layers(
    cfg: Any,
    layers: list[Layer],
    apply: Callable[[Any, dict[str, Any], str], None],
    sources: dict[str, str],
) -> None:
    """Apply each layer's mapping to ``cfg`` in order; record in ``sources`` which file set each
    dotted key last. An error inside a file (an unknown key, a wrong type) names that file."""
    for name, mapping in layers:
        try:
            apply(cfg, mapping, "")
        except ConfigError as e:
            raise ConfigError(e.field, e.value, f"{e.rule} (in {name})", e.fix) from None
        sources.update(dict.fromkeys(leaf_keys(mapping), name))


def leaf_keys(mapping: dict[str, Any], prefix: str = "") -> Iterator[str]:
    """Dotted names of the values a TOML mapping sets (a table recurses, anything else is a leaf,
    an array of tables included)."""
    for key, value in mapping.items():
        dotted = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict):
            yield from leaf_keys(value, dotted)
        else:
            yield dotted


def value_at(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def source_of(cfg: Any, default: Any, sources: dict[str, str], dotted: str) -> str:
    """Where the value of ``dotted`` came from: a file, the command line, the default, or a rule
    that changed it after parsing (``--parallelism.auto``, validation)."""
    if dotted in sources:
        return sources[dotted]
    if value_at(cfg, dotted) != value_at(default, dotted):
        return "derived"
    return DEFAULT


def annotate(toml_text: str, cfg: Any, default: Any, sources: dict[str, str]) -> str:
    """``to_toml``'s output with ``# <source>`` after each value (and each ``[[table]]``)."""
    out: list[str] = []
    section: str | None = ""  # None inside an array of tables
    for line in toml_text.splitlines():
        stripped = line.strip()
        dotted = None
        if stripped.startswith("[[") and stripped.endswith("]]"):
            dotted, section = stripped[2:-2], None
        elif stripped.startswith("[") and stripped.endswith("]"):
            section = stripped[1:-1]
        elif " = " in stripped and section is not None:
            name = stripped.removeprefix("# ").split(" = ", 1)[0]
            if name.isidentifier():
                dotted = f"{section}.{name}" if section else name
        where = source_of(cfg, default, sources, dotted) if dotted else None
        out.append(f"{line}  # {where}" if where else line)
    return "\n".join(out)
