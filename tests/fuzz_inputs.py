"""Strategies and the property of the config fuzzers (tests/unit/test_fuzz_config.py).

The property of every entry point, whatever its input (docs/errors.md): a valid result, or one
line naming the field or file with a fix (exit 2 / ``ConfigError``); never a traceback, and
nothing that existed on disk changed.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import sys
import types
import typing
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from hypothesis import strategies as st

from torchtitan.config.__main__ import main as config_main
from torchtitan.config.manager import iter_fields, parse_args, to_toml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
DEBUG_TOML = str(ROOT / "train_configs" / "debug_model.toml")
FIELDS = [(path, tp, default) for path, tp, default, _doc in iter_fields()]
WORLD_SIZES = st.sampled_from([1, 2, 3, 4, 6, 8, 16, 64])


# --------------------------------------------------------------------------- values
def _strip_optional(tp: Any) -> tuple[Any, bool]:
    if get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        return args[0], True
    return tp, False


_SMALL_INTS = st.sampled_from([-(2**63), -2, -1, 0, 1, 2, 3, 4, 7, 8, 16, 1000, 2**31, 2**64])
_ODD_TEXT = st.text(max_size=12) | st.sampled_from(["", " ", "none", "nan", "-1", "1e9", "a,b"])
_PATHS = st.sampled_from(
    [
        "tests/assets/tokenizer",
        "tests/assets/test_corpus",
        "tests/assets/hf_tokenizer",
        "tests/assets/chat",
        "./missing",
        "/",
        "/dev/null",
        "sandbox_file",
        "sandbox_dir",
        "sandbox_dir/nested/deeper",
    ]
)


_NAMES = st.sampled_from(
    ["llama3", "qwen3", "debugmodel", "debugmodel_moe", "8B", "0.6B", "1B", "405B"]
    + ["test_corpus", "c4", "tokenized", "mixture", "chat", "1F1B", "GPipe", "Interleaved1F1B"]
    + ["ZBVZeroBubble", "DualPipeV", "layers.1", "layers.3", "model", "loss", "output", "2", "op"]
)
_REALISTIC_INTS = st.sampled_from([-1, 0, 1, 2, 3, 4, 8, 16, 64, 128, 256, 512])
_REALISTIC_FLOATS = st.sampled_from([-1.0, 0.0, 1e-4, 0.1, 0.5, 0.9, 0.95, 1.0, 2.0])


def value_for(tp: Any, default: Any = None, valid_type: bool = False) -> st.SearchStrategy[Any]:
    """A value of the annotation ``tp``, valid or not (wrong types are part of the draw unless
    ``valid_type``); realistic values (small ints, known names) dominate, so the draw also
    reaches the cross-field rules and the fit check, not only the type checks."""
    inner, optional = _strip_optional(tp)
    wrong = st.one_of(st.booleans(), _SMALL_INTS, _ODD_TEXT, st.floats())
    if get_origin(inner) is Literal:
        good: st.SearchStrategy[Any] = st.sampled_from(get_args(inner))
    elif inner is bool:
        good = st.booleans()
    elif inner is int:
        good = _REALISTIC_INTS | _REALISTIC_INTS | _SMALL_INTS | st.integers(-10, 100)
    elif inner is float:
        good = _REALISTIC_FLOATS | _REALISTIC_FLOATS | st.floats()
    elif inner is str:
        good = _NAMES | _PATHS | _ODD_TEXT
        if isinstance(default, str):
            good = st.just(default) | good
    elif get_origin(inner) is list:
        (elem,) = get_args(inner)
        if isinstance(elem, type) and hasattr(elem, "__dataclass_fields__"):
            keys = list(elem.__dataclass_fields__) + ["bogus"]
            table = st.dictionaries(
                st.sampled_from(keys), _NAMES | _PATHS | _REALISTIC_FLOATS | wrong, max_size=4
            )
            good = st.lists(table, max_size=3)
        else:
            good = st.lists(value_for(elem, None, valid_type), max_size=3)
    else:  # pragma: no cover - a new annotation kind: teach the fuzzer
        raise AssertionError(f"no strategy for {tp!r}")
    out = good if valid_type else st.one_of(good, good, good, good, wrong)
    return out | st.none() if optional else out


def cli_text(v: Any) -> str:
    """``v`` as the user would type it after ``--section.field``."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list):
        return ",".join(cli_text(x) for x in v)
    return "none" if v is None else str(v)


@st.composite
def field_overrides(draw: st.DrawFn, max_fields: int = 6) -> list[tuple[str, Any]]:
    """Pairs (dotted field, value) drawn from the JobConfig schema; in half the draws every
    value has its field's type (the deeper rules), in the other half anything goes."""
    chosen = draw(st.lists(st.sampled_from(FIELDS), max_size=max_fields))
    typed = draw(st.booleans())
    return [(path, draw(value_for(tp, default, typed))) for path, tp, default in chosen]


# --------------------------------------------------------------------------- TOML writing
def _toml_scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    if isinstance(v, float) and math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # JSON string escapes are TOML basic-string escapes
    if isinstance(v, list):
        return "[" + ", ".join(_toml_scalar(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml_scalar(x)}" for k, x in v.items()) + "}"
    raise TypeError(v)


def _flatten(mapping: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for k, v in mapping.items():
        key = f"{prefix}.{json.dumps(k)}" if prefix else json.dumps(k)
        out += _flatten(v, key) if isinstance(v, dict) else [(key, v)]
    return out


def overrides_as_toml(base: dict[str, Any], overrides: list[tuple[str, Any]]) -> str:
    """The ``base`` tables with ``overrides`` set, as TOML dotted keys (None dropped: TOML has
    no null)."""
    merged: dict[str, Any] = json.loads(json.dumps(base))
    for path, v in overrides:
        if v is None:
            continue
        node = merged
        *parents, leaf = path.split(".")
        for part in parents:
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                nxt = node[part] = {}
            node = nxt
        node[leaf] = v
    return "".join(f"{k} = {_toml_scalar(v)}\n" for k, v in _flatten(merged))


# --------------------------------------------------------------------------- the property
def snapshot(folder: Path) -> dict[str, str]:
    """Every path under ``folder`` with a hash of its content (folders: '<dir>')."""
    out: dict[str, str] = {}
    for p in sorted(folder.rglob("*")):
        rel = str(p.relative_to(folder))
        out[rel] = "<dir>" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def run_config_cli(argv: list[str]) -> tuple[int, str, str]:
    """``python -m torchtitan.config argv`` in process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            rc = config_main(list(argv))
        except BaseException as e:  # a traceback: the property fails
            raise AssertionError(f"traceback from argv={argv!r}: {type(e).__name__}: {e}") from e
    return rc, out.getvalue(), err.getvalue()


def assert_config_property(argv: list[str]) -> int:
    """Exit 0 with a config that loads back to itself, or exit 2 with one line that names a
    field and a fix."""
    rc, out, err = run_config_cli(argv)
    assert rc in (0, 2), (rc, argv, err)
    if rc == 2:
        # One error line, after any warnings the input itself caused ("warning: ...").
        *warned, line = err.strip().splitlines()
        assert all(w.startswith("warning: ") for w in warned), f"argv={argv!r}: {err!r}"
        assert line.startswith("config error: ") and "Fix: " in line, line
        assert "Traceback" not in err
        return rc
    if "-h" in argv or "--help" in argv:
        return rc
    text = out.split("\n== preflight:")[0]
    tomllib.loads(text)  # the printed config is TOML ...
    return rc


def assert_toml_roundtrip(text: str, tmp: Path) -> None:
    """... that parses back to the same config."""
    path = tmp / "roundtrip.toml"
    path.write_text(text, encoding="utf-8")
    again = parse_args(["--job.config_file", str(path)])
    again.job.config_file = tomllib.loads(text).get("job", {}).get("config_file")
    assert to_toml(again) == text.rstrip("\n")
