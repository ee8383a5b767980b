"""Every module of the package imports, and every script compiles, on the installed torch.

The cheapest check of a torch version of the window (``./run_tests.sh --torch 2.11``): a name a
torch release lacks fails at import, before any test could reach it.
"""

from __future__ import annotations

import importlib
import pkgutil
import py_compile
from pathlib import Path

import pytest

import torchtitan

ROOT = Path(__file__).resolve().parents[2]
MODULES = sorted(m.name for m in pkgutil.walk_packages(torchtitan.__path__, "torchtitan."))


@pytest.mark.smoke
def test_every_module_imports() -> None:
    failed = {}
    for name in MODULES:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - every failure is reported together
            failed[name] = f"{type(e).__name__}: {e}"
    assert len(MODULES) > 40, MODULES
    assert not failed, failed


@pytest.mark.smoke
def test_scripts_and_benchmarks_compile(tmp_path: Path) -> None:
    files = sorted([*(ROOT / "scripts").glob("*.py"), *(ROOT / "benchmarks").glob("*.py")])
    assert len(files) >= 8, files
    for i, f in enumerate(files):
        py_compile.compile(str(f), cfile=str(tmp_path / f"{i}.pyc"), doraise=True)
