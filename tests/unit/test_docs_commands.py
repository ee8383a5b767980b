"""Every shell command of README.md, docs/*.md and the shipped configs' headers is in the table
of ``tests/docs_commands.py`` and runs as that table says: config checks, ``--job.explain`` and
the planner as written in the fast tier; training, conversion, evaluation and generation at a
small size in the slow tier; the rest skipped with the reason. Every command's config overrides,
config files and script options are checked against the code in the fast tier."""

from __future__ import annotations

import contextlib
import io
import os
import runpy
import shlex
import subprocess
import sys
import warnings
from functools import cache
from pathlib import Path

import pytest

from tests.docs_commands import COMMANDS, ROOT, Fast, Skip, Slow, all_commands, normal
from torchtitan.config.manager import iter_fields

FOUND = all_commands()


def test_every_command_is_in_the_table() -> None:
    table = {normal(k) for k in COMMANDS}
    missing = [f"{c!r} ({', '.join(FOUND[c])})" for c in FOUND if c not in table]
    assert not missing, "commands the table of tests/docs_commands.py lacks:\n" + "\n".join(missing)
    stale = [c for c in table if c not in FOUND]
    assert not stale, f"table rows no doc holds any more: {stale}"
    assert all(m.reason for m in COMMANDS.values() if isinstance(m, Skip))


# ----------------------------------------------------------------- static checks (fast tier)
_FIELDS = {path for path, *_ in iter_fields()}
# programs of ours whose own options are checked against their --help: (file, subcommand?)
_OURS = ("scripts/", "benchmarks/", "torchtitan.convert", "torchtitan.eval")


def _words(command: str) -> list[str]:
    return shlex.split(command.replace("$COMMON", ""), comments=True)


def _target(words: list[str]) -> tuple[str, list[str]]:
    """The program a ``python``/``torchrun`` command runs (a script path or ``-m`` module) and
    its arguments."""
    i = 0
    while i < len(words) and "=" in words[i] and not words[i].startswith("-"):
        i += 1  # NAME=value
    words = words[i:]
    if words and words[0] in ("python", "torchrun"):
        j = 1
        while j < len(words):
            if words[j] == "-m":
                return words[j + 1], words[j + 2 :]
            if not words[j].startswith("-"):
                return words[j], words[j + 1 :]
            j += 1 if "=" in words[j] or words[j] == "-c" else 2
    return (words[0] if words else ""), words[1:]


def _overrides(args: list[str]) -> list[str]:
    """The ``--section.field`` options among ``args`` (after a ``--`` for the benchmarks)."""
    out = []
    for a in (piece for arg in args for piece in arg.split()):  # "--a '--x.y 1'" too
        key = a.split("=", 1)[0]
        if key.startswith("--") and "." in key and not key[2:].startswith(("/", ".")):
            out.append(key[2:].removeprefix("no-"))
    return out


@cache
def _help(target: str, sub: str) -> str:
    """``--help`` of one of our scripts or modules, run in this process."""
    argv = [target, *([sub] if sub else []), "--help"]
    out = io.StringIO()
    old = sys.argv
    try:
        sys.argv = argv
        quiet = (contextlib.redirect_stdout(out), contextlib.redirect_stderr(out))
        with quiet[0], quiet[1], contextlib.suppress(SystemExit):
            if target.endswith(".py"):
                runpy.run_path(str(ROOT / target), run_name="__main__")
            else:
                with warnings.catch_warnings():
                    # runpy's note that the module was imported before (by an earlier test):
                    # expected in process, and not what a user running `python -m` sees
                    warnings.filterwarnings("ignore", "'.*' found in sys.modules", RuntimeWarning)
                    runpy.run_module(target, run_name="__main__", alter_sys=False)
    finally:
        sys.argv = old
    return out.getvalue()


@pytest.mark.parametrize("command", list(FOUND), ids=range(len(FOUND)))
def test_command_names_real_fields_files_and_options(command: str) -> None:
    words = _words(command)
    for w in words:
        if w.startswith("CONFIG_FILE="):
            for f in w.split("=", 1)[1].split(","):
                assert (ROOT / f).is_file() or f == "my_overlay.toml", f"{f} does not exist"
    for i, w in enumerate(words[:-1]):
        if w == "--job.config_file":
            for f in words[i + 1].split(","):
                assert (ROOT / f).is_file() or f == "my_overlay.toml", f"{f} does not exist"
    target, args = _target(words)
    bad = [o for o in _overrides(args) if o not in _FIELDS]
    assert not bad, f"not fields of the config: {bad}"
    if target.startswith(_OURS) and target != "scripts/gpu_check.sh":
        sub = args[0] if args and args[0] in ("to-hf", "from-hf") else ""
        text = _help(target, sub)
        own = args[: args.index("--")] if "--" in args else args
        options = {a.split("=")[0] for a in own if a.startswith("--") and "." not in a}
        missing = [o for o in options if o not in text]
        assert "usage" in text.lower() and not missing, (missing, text[-2000:])


# ----------------------------------------------------------------- runs as written (fast tier)
FAST = [c for c, m in COMMANDS.items() if isinstance(m, Fast)]


def _in_process(command: str) -> tuple[int, str]:
    """Run ``[ENV=..] python -m torchtitan.{config,plan,train} ...`` through its ``main``."""
    from torchtitan.config.__main__ import main as config_main
    from torchtitan.planner.__main__ import main as plan_main
    from torchtitan.train import main as train_main

    mains = {"torchtitan.config": config_main, "torchtitan.planner": plan_main}
    mains["torchtitan.train"] = train_main
    words = _words(command)
    env = dict(w.split("=", 1) for w in words[: words.index("python")])
    target, args = _target(words)
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(ROOT)
        for k, v in env.items():
            mp.setenv(k, v)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            rc = mains[target](args)
    return rc, out.getvalue()


@pytest.mark.parametrize("command", FAST, ids=range(len(FAST)))
def test_fast_command_runs_as_written(command: str) -> None:
    mode = COMMANDS[command]
    assert isinstance(mode, Fast)
    rc, out = _in_process(command)
    assert rc == mode.rc, out[-3000:]
    assert mode.words in out, out[-3000:]
    assert "Traceback" not in out and "error: job.fit_check" not in out, out[-3000:]


# ----------------------------------------------------------------- small runs (slow tier)
SLOW = [c for c, m in COMMANDS.items() if isinstance(m, Slow)]
_KEEP_OUT = {".git", ".venv", "outputs", "__pycache__", ".pytest_cache", ".mypy_cache"}


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder that mirrors the repository by links, with its own ``outputs/``, and a
    ``bin/python`` that is this interpreter."""
    box = tmp_path_factory.mktemp("docs")
    for entry in ROOT.iterdir():
        if entry.name not in _KEEP_OUT:
            (box / entry.name).symlink_to(entry)
    bin_dir = box / ".bin"
    bin_dir.mkdir()
    # wrappers, not links: a link to a venv's python starts the base interpreter
    for name, run in (("python", ""), ("torchrun", " -m torch.distributed.run")):
        (bin_dir / name).write_text(f'#!/bin/sh\nexec "{sys.executable}"{run} "$@"\n')
        (bin_dir / name).chmod(0o755)
    return box


@pytest.mark.slow
@pytest.mark.parametrize("command", SLOW, ids=range(len(SLOW)))
def test_slow_command_runs_small(command: str, sandbox: Path) -> None:
    mode = COMMANDS[command]
    assert isinstance(mode, Slow)
    env = {k: v for k, v in os.environ.items() if k not in ("NGPU", "LOG_RANK", "CONFIG_FILE")}
    env.update(
        PATH=f"{sandbox / '.bin'}{os.pathsep}{env.get('PATH', '')}",
        PYTHONPATH=str(ROOT),
        TORCHTITAN_PYTHON=sys.executable,
        TORCHTITAN_DEVICE="cpu",
        HF_DATASETS_OFFLINE="1",
    )
    line = f"{command} {mode.extra}".strip()
    proc = subprocess.run(
        ["bash", "-c", line],
        cwd=sandbox,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
