"""Fuzzing the config entry points (issue #28): random bytes and text as TOML files, random
field/value pairs drawn from the JobConfig schema (as TOML and as command-line overrides, on
random world sizes), random command-line token lists.

Property (tests/fuzz_inputs.py): exit 0 with a printed config that is TOML and loads back to
itself, or exit 2 with one line naming a field and a fix; never a traceback, and nothing in the
working folder changed. The fast tier runs a fixed, derandomized budget (tests/conftest.py);
the ``slow`` tests draw >= 2,000 configs afresh.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fuzz_inputs import (
    DEBUG_TOML,
    FIELDS,
    ROOT,
    WORLD_SIZES,
    assert_config_property,
    assert_toml_roundtrip,
    cli_text,
    field_overrides,
    overrides_as_toml,
    run_config_cli,
    snapshot,
    tomllib,
)

BASE = tomllib.loads(Path(DEBUG_TOML).read_text())


def slow(n: int) -> settings:
    """The slow tier's profile with a budget of ``n`` cases."""
    return settings(settings.get_profile("fuzz_slow"), max_examples=n)


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The working folder of every case: a file and a folder the property says stay untouched."""
    root = tmp_path_factory.mktemp("fuzz_config")
    (root / "sandbox_file").write_text("keep me\n")
    (root / "sandbox_dir").mkdir()
    (root / "sandbox_dir" / "inside.txt").write_text("keep me too\n")
    mp = pytest.MonkeyPatch()
    mp.chdir(root)
    yield root
    mp.undo()


def _check(argv: list[str], sandbox: Path) -> int:
    before = snapshot(sandbox)
    rc = assert_config_property(argv)
    assert snapshot(sandbox) == before, f"argv={argv!r} changed the working folder"
    return rc


def _toml_case(sandbox: Path, text: bytes | str, extra: list[str], world: int) -> int:
    path = sandbox / "fuzz_case.toml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass"))
    try:
        return _check(["--job.config_file", str(path), "--world_size", str(world), *extra], sandbox)
    finally:
        path.unlink()


def toml_bytes_case(sandbox: Path, data: bytes, world: int) -> None:
    _toml_case(sandbox, data, [], world)


def toml_text_case(sandbox: Path, text: str, world: int) -> None:
    _toml_case(sandbox, text, [], world)


def schema_toml_case(sandbox: Path, overrides: list[tuple[str, Any]], world: int) -> None:
    _toml_case(sandbox, overrides_as_toml(BASE, overrides), [], world)


def schema_cli_case(sandbox: Path, overrides: list[tuple[str, Any]], world: int) -> None:
    argv = ["--job.config_file", DEBUG_TOML, "--world_size", str(world)]
    for path, value in overrides:
        argv += [f"--{path}", cli_text(value)]
    rc = _check(argv, sandbox)
    if rc == 0:  # the printed config loads back to itself
        out = run_config_cli(argv)[1]
        assert_toml_roundtrip(out.split("\n== preflight:")[0], sandbox / "sandbox_dir")
        (sandbox / "sandbox_dir" / "roundtrip.toml").unlink()


_FIELD_NAMES = [p for p, _tp, _default in FIELDS]
_TOKENS = st.one_of(
    st.sampled_from(_FIELD_NAMES).map(lambda p: f"--{p}"),
    st.sampled_from(_FIELD_NAMES).map(lambda p: f"--no-{p}"),
    st.sampled_from(_FIELD_NAMES).map(lambda p: f"--{p.replace('.', '-')}="),
    st.sampled_from(["--", "-h", "--world_size", "--job.config_file", "-x", "--.", "--a..b"]),
    st.sampled_from(["1", "0", "-1", "true", "nan", "1e9", DEBUG_TOML, "a,b", ""]),
    st.text(max_size=10),
)


def cli_tokens_case(sandbox: Path, tokens: list[str]) -> None:
    _check(["--job.config_file", DEBUG_TOML, *tokens], sandbox)


# --------------------------------------------------------------------------- fast tier
@settings(max_examples=40)
@given(data=st.binary(max_size=200), world=WORLD_SIZES)
def test_fuzz_toml_bytes(sandbox: Path, data: bytes, world: int) -> None:
    toml_bytes_case(sandbox, data, world)


@settings(max_examples=40)
@given(text=st.text(max_size=200), world=WORLD_SIZES)
def test_fuzz_toml_text(sandbox: Path, text: str, world: int) -> None:
    toml_text_case(sandbox, text, world)


@settings(max_examples=80)
@given(overrides=field_overrides(), world=WORLD_SIZES)
def test_fuzz_schema_toml(sandbox: Path, overrides: list[tuple[str, Any]], world: int) -> None:
    schema_toml_case(sandbox, overrides, world)


@settings(max_examples=80)
@given(overrides=field_overrides(), world=WORLD_SIZES)
def test_fuzz_schema_cli(sandbox: Path, overrides: list[tuple[str, Any]], world: int) -> None:
    schema_cli_case(sandbox, overrides, world)


@settings(max_examples=60)
@given(tokens=st.lists(_TOKENS, max_size=6))
def test_fuzz_cli_tokens(sandbox: Path, tokens: list[str]) -> None:
    cli_tokens_case(sandbox, tokens)


# --------------------------------------------------------------------------- named cases
def test_utf16_toml_is_one_line(sandbox: Path) -> None:
    text = Path(DEBUG_TOML).read_text().encode("utf-16")
    rc, _out, err = run_config_cli(["--job.config_file", _write(sandbox, text)])
    assert rc == 2
    assert err.strip() == (
        f"config error: job.config_file = '{sandbox / 'case.toml'}': is not UTF-8 text "
        "(byte 0: invalid start byte); TOML files must be UTF-8. Fix: save the file as UTF-8."
    )


def _write(sandbox: Path, data: bytes) -> str:
    (sandbox / "case.toml").write_bytes(data)
    return str(sandbox / "case.toml")


@pytest.mark.parametrize(
    ("argv", "rc", "needle"),
    [
        ([], 0, "[training]"),
        (
            ["--launch", "--training.seq_len", "100000000"],
            2,
            "job.fit_check = 'error': the job does not fit",
        ),
        (["--world_size", "0"], 2, "--world_size"),
        (["--job.config_file", "{utf16}"], 2, "is not UTF-8 text"),
    ],
)
def test_config_subprocess_exit_code_and_one_line(
    tmp_path: Path, argv: list[str], rc: int, needle: str
) -> None:
    """The real ``python -m torchtitan.config``: the exit code, and stderr is one line."""
    utf16 = tmp_path / "utf16.toml"
    utf16.write_bytes(Path(DEBUG_TOML).read_text().encode("utf-16"))
    argv = [a.replace("{utf16}", str(utf16)) for a in argv]
    proc = subprocess.run(
        [sys.executable, "-m", "torchtitan.config", "--job.config_file", DEBUG_TOML, *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == rc, proc.stderr
    if rc == 0:
        assert needle in proc.stdout and proc.stderr == ""
    else:
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert needle in proc.stderr and "Traceback" not in proc.stderr


# --------------------------------------------------------------------------- slow tier
# Budgets: 300 + 300 + 600 + 600 + 400 = 2,200 config cases.
@pytest.mark.slow
@slow(300)
@given(data=st.binary(max_size=2000), world=WORLD_SIZES)
def test_fuzz_toml_bytes_large(sandbox: Path, data: bytes, world: int) -> None:
    toml_bytes_case(sandbox, data, world)


@pytest.mark.slow
@slow(300)
@given(text=st.text(max_size=2000), world=WORLD_SIZES)
def test_fuzz_toml_text_large(sandbox: Path, text: str, world: int) -> None:
    toml_text_case(sandbox, text, world)


@pytest.mark.slow
@slow(600)
@given(overrides=field_overrides(max_fields=12), world=WORLD_SIZES)
def test_fuzz_schema_toml_large(
    sandbox: Path, overrides: list[tuple[str, Any]], world: int
) -> None:
    schema_toml_case(sandbox, overrides, world)


@pytest.mark.slow
@slow(600)
@given(overrides=field_overrides(max_fields=12), world=WORLD_SIZES)
def test_fuzz_schema_cli_large(sandbox: Path, overrides: list[tuple[str, Any]], world: int) -> None:
    schema_cli_case(sandbox, overrides, world)


@pytest.mark.slow
@slow(400)
@given(tokens=st.lists(_TOKENS, max_size=12))
def test_fuzz_cli_tokens_large(sandbox: Path, tokens: list[str]) -> None:
    cli_tokens_case(sandbox, tokens)
