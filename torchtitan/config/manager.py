"""Load a JobConfig: defaults < TOML files (their ``extends`` chains: config/compose.py) < command
line, with strict keys and types.

Command-line overrides are ``--section.field value`` or ``--section.field=value``; nested
sections use more dots (``--quantize.dense.float8.enable``); booleans may be bare flags or
``--no-section.field``; lists are comma-separated; a field of table N of a ``[[section.field]]``
list the TOML file gave is ``--section.field.N.key``. An unknown key anywhere is a ConfigError that
lists the valid keys of that section.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import json
import sys
import types
import typing
from functools import cache
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from torchtitan.config import compose
from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


# --------------------------------------------------------------------------- schema helpers
# int and float fields: the TOML types each accepts, and the rule a bad value breaks
_NUMBERS: dict[type, tuple[tuple[type, ...], str]] = {
    int: ((int,), "must be an integer"),
    float: ((int, float), "must be a number"),
}


@cache
def field_docs(cls: Any) -> dict[str, str]:
    """Attribute docstrings (the string literal right after each field) of a dataclass."""
    tree = ast.parse(inspect.getsource(sys.modules[cls.__module__]))
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            docs: dict[str, str] = {}
            body = node.body
            for stmt, nxt in zip(body, body[1:]):
                if (
                    isinstance(stmt, ast.AnnAssign)
                    and isinstance(stmt.target, ast.Name)
                    and isinstance(nxt, ast.Expr)
                    and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)
                ):
                    docs[stmt.target.id] = " ".join(nxt.value.value.split())
            return docs
    return {}


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _strip_optional(tp: Any) -> tuple[Any, bool]:
    if get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(get_args(tp)) == 2:
            return args[0], True
    return tp, False


def type_name(tp: Any) -> str:
    inner, optional = _strip_optional(tp)
    if get_origin(inner) is Literal:
        name = " | ".join(repr(a) for a in get_args(inner))
    elif get_origin(inner) is list and _is_dataclass_type(get_args(inner)[0]):
        name = f"list[{get_args(inner)[0].__name__}] ([[section.field]] tables)"
    elif get_origin(inner) is list:
        name = f"list[{get_args(inner)[0].__name__}] (comma-separated)"
    else:
        name = getattr(inner, "__name__", str(inner))
    return f"{name} | None" if optional else name


def _convert(path: str, raw: Any, tp: Any, from_cli: bool) -> Any:
    """Check (TOML) or parse (command line) one value against its annotation."""
    inner, optional = _strip_optional(tp)
    if optional and (raw is None or (from_cli and str(raw).lower() in {"none", "null", ""})):
        return None

    def bad(rule: str) -> ConfigError:
        return ConfigError(path, raw, rule, f"give a value of type {type_name(tp)}")

    if get_origin(inner) is Literal:
        choices = get_args(inner)
        if raw in choices:
            return raw
        if isinstance(raw, str):
            for c in choices:
                if isinstance(c, str) and c.lower() == raw.lower():
                    return c
        raise ConfigError(
            path, raw, f"must be one of {list(choices)}", f"pick one of {list(choices)}"
        )
    if inner is bool:
        if isinstance(raw, bool):
            return raw
        if from_cli and str(raw).lower() in _TRUE | _FALSE:
            return str(raw).lower() in _TRUE
        raise bad("must be a boolean (true/false)")
    if inner in _NUMBERS:
        numbers, rule = _NUMBERS[inner]
        if isinstance(raw, numbers) and not isinstance(raw, bool):
            return inner(raw)
        if from_cli:
            try:
                return inner(str(raw))
            except ValueError:
                pass
        raise bad(rule)
    if inner is str:
        if isinstance(raw, str):
            return raw
        raise bad("must be a string")
    if get_origin(inner) is list:
        (elem,) = get_args(inner)
        if _is_dataclass_type(elem):
            return _convert_tables(path, raw, elem, from_cli)
        if from_cli and isinstance(raw, str):
            items: list[Any] = [s.strip() for s in raw.split(",") if s.strip()]
        elif isinstance(raw, list):
            items = raw
        else:
            raise bad("must be a list")
        return [_convert(f"{path}[{i}]", v, elem, from_cli) for i, v in enumerate(items)]
    raise TypeError(f"unsupported config annotation {tp!r} at {path}")  # internal invariant


def _convert_tables(path: str, raw: Any, elem: type, from_cli: bool) -> list[Any]:
    """A TOML array of tables (``[[training.mixture]]``) as a list of ``elem`` dataclasses."""
    if from_cli:
        raise ConfigError(
            path,
            raw,
            "is a list of tables",
            f"write [[{path}]] tables in the TOML file; --{path}.N.<field> overrides table N",
        )
    if not isinstance(raw, list) or not all(isinstance(t, dict) for t in raw):
        raise ConfigError(path, raw, "must be a list of tables", f"write [[{path}]] tables")
    items = []
    for i, table in enumerate(raw):
        obj = elem()
        _apply_mapping(obj, table, f"{path}[{i}]")
        items.append(obj)
    return items


def _unknown_key(section_path: str, key: str, cls: type) -> ConfigError:
    """``key`` is no field of the section ``cls``: name the nearest field there, or the same
    field name in another section (``training.lr`` -> ``optimizer.lr``)."""
    valid = [f.name for f in dataclasses.fields(cls)]
    where = f"[{section_path}]" if section_path else "the top level"
    full = f"{section_path}.{key}" if section_path else key
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if close:
        hint = f"did you mean '{close[0]}'? "
    else:
        elsewhere = [p for p, *_ in iter_fields() if p.rsplit(".", 1)[-1] == key]
        hint = f"did you mean '{elsewhere[0]}'? " if elsewhere else ""
    kind = "a field" if section_path else "a section"
    return ConfigError(
        full, None, f"is not {kind} of {where}", f"{hint}valid keys of {where}: {', '.join(valid)}"
    )


# --------------------------------------------------------------------------- TOML
def _apply_mapping(obj: Any, mapping: dict[str, Any], prefix: str) -> None:
    cls = type(obj)
    hints = _hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key, raw in mapping.items():
        if key not in names:
            raise _unknown_key(prefix, key, cls)
        path = f"{prefix}.{key}" if prefix else key
        tp = hints[key]
        if _is_dataclass_type(tp):
            if not isinstance(raw, dict):
                raise ConfigError(path, raw, "is a section", f"write it as a [{path}] table")
            _apply_mapping(getattr(obj, key), raw, path)
        else:
            setattr(obj, key, _convert(path, raw, tp, from_cli=False))


def load_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if p.is_dir():
        raise ConfigError(
            "job.config_file",
            str(path),
            "is a folder, not a TOML file",
            "name a .toml file (e.g. train_configs/debug_model.toml)",
        )
    if not p.is_file():
        raise ConfigError(
            "job.config_file", str(path), "must be an existing TOML file", "check the path"
        )
    try:
        with p.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(
            "job.config_file", str(path), f"is not valid TOML ({e})", "fix the syntax"
        ) from None
    except UnicodeDecodeError as e:  # TOML is UTF-8 only (e.g. a file saved as UTF-16)
        raise ConfigError(
            "job.config_file",
            str(path),
            f"is not UTF-8 text (byte {e.start}: {e.reason}); TOML files must be UTF-8",
            "save the file as UTF-8",
        ) from None
    except OSError as e:  # e.g. no read permission
        raise ConfigError(
            "job.config_file", str(path), f"cannot be read ({e.strerror})", "check the file"
        ) from None


# --------------------------------------------------------------------------- command line
def _resolve(cfg: JobConfig, dotted: str) -> tuple[Any, str, Any]:
    """(owner object, field name, annotation) for a dotted path, or a ConfigError."""
    parts = dotted.split(".")
    obj: Any = cfg
    prefix = ""
    for i, part in enumerate(parts):
        if isinstance(obj, list):  # a table of a [[section.field]] list, by index
            obj, prefix = _table(obj, part, prefix)
            continue
        cls = type(obj)
        if part not in {f.name for f in dataclasses.fields(cls)}:
            raise _unknown_key(prefix, part, cls)
        tp = _hints(cls)[part]
        if i == len(parts) - 1:
            if _is_dataclass_type(tp):
                raise ConfigError(
                    dotted,
                    None,
                    "is a section, not a field",
                    f"give a field, e.g. --{dotted}.<field>",
                )
            return obj, part, tp
        if not _is_dataclass_type(tp) and not _is_table_list(tp):
            raise ConfigError(
                dotted, None, f"'{part}' is a field, not a section", "remove the extra dotted part"
            )
        obj = getattr(obj, part)
        prefix = f"{prefix}.{part}" if prefix else part
    raise AssertionError("unreachable")


def _is_table_list(tp: Any) -> bool:
    return get_origin(tp) is list and _is_dataclass_type(get_args(tp)[0])


def _table(tables: list[Any], index: str, prefix: str) -> tuple[Any, str]:
    """``--section.field.N.key``: table N of a list of tables that the TOML file gave."""
    if not index.isdigit() or int(index) >= len(tables):
        fix = f"add [[{prefix}]] tables to the TOML file"
        if tables:
            fix = f"write --{prefix}.N.<field> with N in 0..{len(tables) - 1}, or {fix}"
        raise ConfigError(
            f"{prefix}.{index}",
            None,
            f"names no table of {prefix} (the TOML file gives {len(tables)})",
            fix,
        )
    return tables[int(index)], f"{prefix}.{index}"


def _leaf_type(dotted: str) -> Any | None:
    """The annotation of the leaf field ``dotted`` (None when it names no field)."""
    cls: Any = JobConfig
    for part in dotted.split("."):
        if _is_table_list(cls) and part.isdigit():
            cls = get_args(cls)[0]
            continue
        if not _is_dataclass_type(cls) or part not in {f.name for f in dataclasses.fields(cls)}:
            return None
        cls = _hints(cls)[part]
    return None if _is_dataclass_type(cls) else cls


def _negation(key: str) -> str | None:
    """For ``no_section.field`` or ``section.no_field`` (tyro's spelling), the field it negates
    when ``key`` itself is no field and the negated one is; None otherwise. Only boolean fields
    take the negation: the caller reports ``--no-`` on another type."""
    if _leaf_type(key) is not None:
        return None
    head, _, last = key.rpartition(".")
    for cand in (
        key[3:] if key.startswith("no_") else None,
        f"{head}.{last[3:]}" if head and last.startswith("no_") else None,
    ):
        if cand and _leaf_type(cand) is not None:
            return cand
    return None


def _split_cli(argv: list[str]) -> list[tuple[str, str | None, bool]]:
    """Turn argv into (dotted key, raw value or None for a bare flag, negated)."""
    out: list[tuple[str, str | None, bool]] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        if not tok.startswith("--") or tok == "--":
            raise ConfigError(
                "<command line>",
                tok,
                "is not an option",
                "write overrides as --section.field value",
            )
        body = tok[2:]
        value: str | None = None
        if "=" in body:
            body, value = body.split("=", 1)
        key = body.replace("-", "_")
        # --no-section.field and tyro's --section.no-field negate a boolean, but only when the
        # key as written is no field: a field may itself start with no_.
        negated_key = _negation(key)
        negated = negated_key is not None
        if negated_key is not None:
            key = negated_key
        takes_value = not negated or _strip_optional(_leaf_type(key))[0] is not bool
        if value is None and takes_value and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            value = argv[i + 1]
            i += 1
        out.append((key, value, negated))
        i += 1
    return out


def _apply_cli(cfg: JobConfig, items: list[tuple[str, str | None, bool]]) -> None:
    for key, value, negated in items:
        owner, name, tp = _resolve(cfg, key)
        inner, _ = _strip_optional(tp)
        if inner is bool:
            if negated:
                if value is not None:
                    raise ConfigError(
                        key,
                        value,
                        "--no-<flag> takes no value",
                        f"write --no-{key} or --{key}=false",
                    )
                setattr(owner, name, False)
            else:
                setattr(
                    owner, name, True if value is None else _convert(key, value, tp, from_cli=True)
                )
            continue
        if negated:
            raise ConfigError(
                key, None, "--no- only applies to boolean fields", f"write --{key} <value>"
            )
        if value is None:
            raise ConfigError(key, None, "needs a value", f"write --{key} <{type_name(tp)}>")
        setattr(owner, name, _convert(key, value, tp, from_cli=True))


def parse_args(argv: list[str] | None = None) -> JobConfig:
    """Build the JobConfig from ``argv`` (defaults < --job.config_file TOML files and their
    ``extends`` chains, in order < other overrides; config/compose.py).
    Only parses: ``torchtitan.preflight.validate.load_config`` parses and validates."""
    return parse_args_with_sources(argv)[0]


def parse_args_with_sources(argv: list[str] | None = None) -> tuple[JobConfig, dict[str, str]]:
    """``parse_args``, plus where each value that is not a default came from: dotted field ->
    the file that set it last, or ``"command line"``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    items = _split_cli(argv)
    cfg = JobConfig()
    sources: dict[str, str] = {}
    files = compose.split_files([v for k, v, _ in items if k == "job.config_file"])
    compose.apply_layers(cfg, compose.layers_of(files, load_toml), _apply_mapping, sources)
    _apply_cli(cfg, items)
    if files:
        cfg.job.config_file = ",".join(files)
    sources.update(dict.fromkeys((k for k, _, _ in items), compose.COMMAND_LINE))
    return cfg, sources


# --------------------------------------------------------------------------- output
def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):  # a TOML basic string: JSON's escapes, and DEL (TOML forbids it raw)
        return json.dumps(v, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} as TOML")


def to_toml(cfg: Any, prefix: str = "") -> str:
    """The config as TOML (None fields are written as comments, since TOML has no null)."""
    scalars, tables = [], []
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if isinstance(v, list) and v and dataclasses.is_dataclass(v[0]):
            name = f"{prefix}.{f.name}" if prefix else f.name
            tables += [f"[[{name}]]\n" + to_toml(item) for item in v]
        elif dataclasses.is_dataclass(v):
            tables.append(to_toml(v, f"{prefix}.{f.name}" if prefix else f.name))
        elif v is None:
            scalars.append(f"# {f.name} = (unset)")
        else:
            scalars.append(f"{f.name} = {_toml_value(v)}")
    head = [f"[{prefix}]"] + scalars if prefix and scalars else scalars
    return "\n\n".join(s for s in ["\n".join(head)] + tables if s)


def iter_fields(
    cls: type = JobConfig, prefix: str = ""
) -> typing.Iterator[tuple[str, Any, Any, str]]:
    """(dotted name, annotation, default, docstring) for every leaf field, in declaration order."""
    obj = cls()
    for f in dataclasses.fields(cls):
        tp = _hints(cls)[f.name]
        path = f"{prefix}.{f.name}" if prefix else f.name
        if _is_dataclass_type(tp):
            yield from iter_fields(tp, path)
        else:
            yield path, tp, getattr(obj, f.name), field_docs(cls).get(f.name, "")


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """A wrapper script's own arguments and the trainer's overrides after ``--`` (the
    benchmarks' ``script.py [own args] -- [--section.field value ...]``)."""
    if "--" not in argv:
        return list(argv), []
    cut = argv.index("--")
    return list(argv[:cut]), list(argv[cut + 1 :])


def asked_for_help(argv: list[str]) -> bool:
    """Prints :func:`help_text` and says True when ``argv`` holds ``-h`` or ``--help`` (the
    command-line entry points' first check)."""
    if "-h" in argv or "--help" in argv:
        print(help_text())
        return True
    return False


def help_text() -> str:
    lines = [
        "usage: python -m torchtitan.train --job.config_file FILE [--section.field VALUE ...]",
        "",
    ]
    section = None
    for path, tp, default, doc in iter_fields():
        sec = path.rsplit(".", 1)[0]
        if sec != section:
            lines.append(f"[{sec}]")
            section = sec
        lines.append(f"  --{path} {type_name(tp)} (default: {default!r})")
        lines.append(f"      {doc}")
    return "\n".join(lines)
