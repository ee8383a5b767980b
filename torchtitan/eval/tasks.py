"""Which lm-eval tasks a config names, where their data is, and whether it can be read offline.

:func:`resolve_tasks` is run by the config validator (``preflight/validate_eval.py``), before any
process group or model exists, and again by the evaluation itself. For each name of
``eval.tasks`` it finds the task in lm-eval's index (stock tasks plus the YAMLs under
``eval.include_path``) and raises a one-line :class:`ConfigError` naming it when

- the name is no task, group or tag lm-eval knows;
- a local data file of the task (``dataset_path: json``/``csv``/``parquet``/... with
  ``data_files``) does not exist;
- the task reads a dataset from the Hugging Face Hub, the Hub is switched off
  (``HF_DATASETS_OFFLINE``/``HF_HUB_OFFLINE``) and the dataset is not in the local cache.

A task from an include folder is handed to lm-eval as its config with relative ``data_files``
made absolute from the YAML's folder, so local tasks work from any working directory
(docs/evaluation.md).
"""

from __future__ import annotations

import copy
import functools
import os
from pathlib import Path
from typing import Any

from torchtitan.config.errors import ConfigError
from torchtitan.tools.paths import resolve_repo_path

__all__ = ["hub_offline", "resolve_tasks", "task_manager"]

LOCAL_BUILDERS = {"json", "csv", "parquet", "text", "arrow", "pandas"}
"""``dataset_path`` values that read local ``data_files`` rather than a Hub dataset."""

_TRUE = {"1", "true", "yes", "on"}


def hub_offline() -> bool:
    """Whether the Hugging Face Hub is switched off for datasets in this environment."""
    names = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")
    return any(os.environ.get(n, "").strip().lower() in _TRUE for n in names)


def _include_paths(paths: list[str]) -> tuple[Path, ...]:
    found = []
    for p in paths:
        resolved = resolve_repo_path(p)
        if not resolved.is_dir():
            raise ConfigError(
                "eval.include_path",
                p,
                "is not a folder (looked in the working directory and the repository root)",
                "name folders of task YAMLs, e.g. tests/assets/eval",
            )
        found.append(resolved.resolve())
    return tuple(found)


@functools.lru_cache(maxsize=4)
def _manager(paths: tuple[Path, ...]) -> Any:
    import logging

    from lm_eval.tasks import TaskManager

    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    return TaskManager(include_path=[str(p) for p in paths] or None)


def task_manager(include_path: list[str]) -> Any:
    """lm-eval's ``TaskManager`` over its stock tasks and ``include_path`` (cached)."""
    return _manager(_include_paths(include_path))


def _cached_on_disk(repo: str) -> bool:
    """Whether the Hub dataset ``repo`` has been downloaded into a local cache before."""
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    datasets_cache = Path(os.environ.get("HF_DATASETS_CACHE", home / "datasets"))
    hub_cache = Path(os.environ.get("HF_HUB_CACHE", home / "hub"))
    return (datasets_cache / repo.replace("/", "___")).is_dir() or (
        hub_cache / f"datasets--{repo.replace('/', '--')}"
    ).is_dir()


def _data_files(cfg: dict[str, Any], base: Path) -> list[Path]:
    """Every local data file of ``cfg`` as an absolute path, relative ones made absolute from
    ``base`` in ``cfg`` itself."""
    kwargs = cfg.get("dataset_kwargs") or {}
    files = kwargs.get("data_files")
    if files is None:
        return []

    def fix(f: str) -> str:
        p = Path(f).expanduser()
        return str(p if p.is_absolute() else base / p)

    if isinstance(files, str):
        kwargs["data_files"] = fix(files)
    elif isinstance(files, list):
        kwargs["data_files"] = [fix(f) for f in files]
    elif isinstance(files, dict):
        kwargs["data_files"] = {
            k: [fix(f) for f in v] if isinstance(v, list) else fix(v) for k, v in files.items()
        }
    out = kwargs["data_files"]
    flat = out.values() if isinstance(out, dict) else [out]
    return [Path(f) for v in flat for f in (v if isinstance(v, list) else [v])]


def _check_data(name: str, cfg: dict[str, Any], yaml: Path | None) -> None:
    source = f" ({yaml})" if yaml else ""
    for f in _data_files(cfg, yaml.parent if yaml else Path.cwd()):
        if not f.is_file():
            raise ConfigError(
                "eval.tasks",
                name,
                f"its data file {f} does not exist{source}",
                "make it (tests/assets/eval: python scripts/make_eval_tasks.py) or fix "
                "data_files in the task YAML",
            )
    path = cfg.get("dataset_path")
    if not isinstance(path, str) or path in LOCAL_BUILDERS:
        return
    local = Path(path).expanduser()
    if not local.is_absolute() and yaml is not None:
        local = yaml.parent / local
    if local.is_dir():
        cfg["dataset_path"] = str(local)
        return
    if hub_offline() and not _cached_on_disk(path):
        raise ConfigError(
            "eval.tasks",
            name,
            f"needs the network: its dataset {path!r} is on the Hugging Face Hub, not in the "
            "local cache, and HF_DATASETS_OFFLINE/HF_HUB_OFFLINE is set",
            "point the task at a local copy of its data (docs/evaluation.md) or download the "
            "dataset once with the network on",
        )


def _leaf_configs(tm: Any, name: str, seen: set[str]) -> list[tuple[str, dict, Path | None]]:
    """(name, config, YAML) of every task ``name`` stands for (itself, a group's or a tag's)."""
    from lm_eval.tasks._yaml_loader import load_yaml

    entry = tm.task_index.get(name)
    if entry is None or name in seen:
        return []
    seen.add(name)
    kind = entry.kind.name
    if kind == "TAG":
        members = [n for n, e in tm.task_index.items() if name in (e.tags or ())]
        return [leaf for m in members for leaf in _leaf_configs(tm, m, seen)]
    if entry.yaml_path is None:
        return [(name, dict(entry.cfg or {}), None)]
    cfg = load_yaml(entry.yaml_path, resolve_func=False)
    if kind == "GROUP":
        children = cfg.get("task") or []
        names = [c if isinstance(c, str) else c.get("task") for c in children]
        return [leaf for n in names if isinstance(n, str) for leaf in _leaf_configs(tm, n, seen)]
    return [(name, cfg, Path(entry.yaml_path))]


def resolve_tasks(tasks: list[str], include_path: list[str]) -> list[str | dict[str, Any]]:
    """The specs to hand lm-eval for ``tasks`` (names, or configs of local tasks); ConfigError
    when a task is unknown, misses a local file, or needs the network while offline."""
    tm = task_manager(include_path)
    roots = _include_paths(include_path)
    specs: list[str | dict[str, Any]] = []
    for name in tasks:
        if tm.task_index.get(name) is None:
            raise ConfigError(
                "eval.tasks",
                name,
                "is no task, group or tag of lm-eval's stock tasks or of the YAMLs under "
                f"eval.include_path {include_path}",
                "fix the name (`lm_eval ls tasks` lists the stock ones) or add the task's YAML "
                "to an eval.include_path folder",
            )
        leaves = _leaf_configs(tm, name, set())
        for leaf, cfg, yaml in leaves:
            _check_data(leaf, cfg, yaml)
        entry = tm.task_index[name]
        local = entry.yaml_path is not None and any(
            Path(entry.yaml_path).resolve().is_relative_to(r) for r in roots
        )
        if local and entry.kind.name == "TASK":
            _, cfg, yaml = leaves[0]
            from lm_eval.tasks._yaml_loader import load_yaml

            full = copy.deepcopy(load_yaml(entry.yaml_path, resolve_func=True))
            full["dataset_kwargs"] = cfg.get("dataset_kwargs")
            full["dataset_path"] = cfg.get("dataset_path")
            specs.append(full)
        else:
            specs.append(name)
    return specs
