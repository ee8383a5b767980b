"""One loader for the scripts and benchmarks the tests call as modules (they are files, not
packages): ``load("scripts/generate.py")``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load(relative_path: str, name: str | None = None) -> ModuleType:
    """The module at ``ROOT / relative_path``, executed once per call and registered in
    ``sys.modules`` under ``name`` (default: the file's stem), where dataclasses and pickling
    look their module up."""
    path = ROOT / relative_path
    name = name or path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
