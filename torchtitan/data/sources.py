"""Where text comes from: registered datasets, local files and folders (JSONL, JSON, parquet,
text, gzipped or not, with split folders/files recognised by name) and hub datasets, opened as
streaming Hugging Face ``IterableDataset``s (docs/data.md). Nothing here touches the network
unless a hub dataset is requested."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchtitan.data.checks import DataError, DataSource
from torchtitan.tools.paths import resolve_repo_path

if TYPE_CHECKING:  # ``datasets`` (pandas, pyarrow) is imported when a dataset is opened
    from datasets import IterableDataset as HFIterableDataset

__all__ = [
    "DATASETS",
    "DatasetSpec",
    "Fields",
    "load_text_dataset",
    "local_data_files",
    "local_source",
]


@dataclass(frozen=True)
class Fields:
    """The config fields an error about a dataset names: the one holding its name and the one
    holding its local path (``[training]``'s by default; a mixture table's are
    ``training.mixture[i].dataset`` / ``.path``, validation's ``validation.dataset[_path]``)."""

    name: str = "training.dataset"
    path: str = "training.dataset_path"

    @classmethod
    def of(cls, section: str) -> Fields:
        return cls(f"{section}.dataset", f"{section}.dataset_path")

    @classmethod
    def mixture(cls, i: int) -> Fields:
        return cls(f"training.mixture[{i}].dataset", f"training.mixture[{i}].path")

    def naming(self, path_given: bool) -> Fields:
        """A given path is named by the path field; a name's default location by the name's."""
        return self if path_given else Fields(self.name, self.name)


TRAINING = Fields()

# File name endings -> `datasets` packaged builder (compressed json/txt are read transparently).
_BUILDERS = {
    ".jsonl": "json",
    ".json": "json",
    ".jsonl.gz": "json",
    ".json.gz": "json",
    ".parquet": "parquet",
    ".txt": "text",
    ".txt.gz": "text",
}
# File/folder names that mark a split (matched as whole words in the path relative to the root).
_SPLIT_ALIASES = {
    "train": ("train",),
    "validation": ("validation", "valid", "val", "dev", "eval"),
    "test": ("test",),
}


def _builder_for(path: Path) -> str | None:
    name = path.name.lower()
    return next((b for ext, b in _BUILDERS.items() if name.endswith(ext)), None)


def _mentions(rel_path: str, names: tuple[str, ...]) -> bool:
    return any(re.search(rf"(?<![a-z]){n}(?![a-z])", rel_path.lower()) for n in names)


def _load_local(path: str, split: str, fields: Fields = TRAINING) -> HFIterableDataset:
    """A file, or a directory of .json/.jsonl/.parquet/.txt files, as a streaming dataset
    (which files: :func:`local_data_files`; errors name ``fields.path``)."""
    files = local_data_files(path, split, fields.path)
    builder = _builder_for(files[0])
    assert builder is not None
    kwargs: dict[str, Any] = {"sample_by": "paragraph"} if builder == "text" else {}
    from datasets import load_dataset

    return load_dataset(
        builder, data_files={split: [str(p) for p in files]}, split=split, streaming=True, **kwargs
    )


def local_data_files(path: str, split: str, field: str = "training.dataset_path") -> list[Path]:
    """The files of a local dataset ``path`` (named by the config ``field``) for ``split``.

    In a directory, the files whose relative path names the split (``train.jsonl``,
    ``validation/part-0.parquet``, ``c4-validation.00000.json.gz``) are used; a directory whose
    files name no split at all is the ``train`` split. ``.txt`` files give one example per
    paragraph (blank-line separated)."""
    root = resolve_repo_path(path)
    kinds = "/".join(sorted(set(_BUILDERS)))
    if not root.exists():
        raise DataError(
            field,
            path,
            "does not exist (looked in the working directory and the repository root)",
            f"give a file or a directory of {kinds} files",
        )
    if root.is_file():
        files = [root]
    else:
        candidates = sorted(p for p in root.rglob("*") if p.is_file() and _builder_for(p))
        rel = {p: p.relative_to(root).as_posix() for p in candidates}
        files = [p for p in candidates if _mentions(rel[p], _SPLIT_ALIASES.get(split, (split,)))]
        all_aliases = tuple(a for names in _SPLIT_ALIASES.values() for a in names)
        if not files and split == "train":
            files = [p for p in candidates if not _mentions(rel[p], all_aliases)]
        if not files:
            raise DataError(
                field,
                path,
                f"no data files for split {split!r} in {root} (found {len(candidates)} "
                f"{kinds} files)",
                f"name them after the split, e.g. {split}.jsonl or {split}/part-0.parquet",
            )
    builders = {_builder_for(p) for p in files}
    if None in builders or len(builders) != 1:
        raise DataError(
            field,
            path,
            f"needs files of one kind among {kinds}, got {[p.name for p in files[:5]]}",
            "give one file, or a directory of files of one kind",
        )
    return files


def local_source(
    dataset: str, dataset_path: str | None, split: str, fields: Fields = TRAINING
) -> DataSource | None:
    """The local files :func:`load_text_dataset` reads for these settings (None for a hub
    dataset), named by the config field that points at them."""
    spec = DATASETS.get(dataset)
    if spec is not None and spec.loader is not _load_local:
        return None
    if spec is not None or dataset_path:
        field = fields.path if dataset_path else fields.name
        path = dataset_path or (spec.default_path if spec is not None else dataset)
    elif resolve_repo_path(dataset).exists():
        field, path = fields.name, dataset
    else:
        _check_not_a_missing_path(dataset, fields)
        return None
    column = spec.text_column if spec is not None else "text"
    return DataSource(field, path, local_data_files(path, split, field), column)


def _load_hub(
    path: str, split: str, fields: Fields = TRAINING, config_name: str | None = None
) -> HFIterableDataset:
    """A Hugging Face hub dataset (or a local clone of one), streamed."""
    local = resolve_repo_path(path)
    if local.exists():
        path = str(local)
    from datasets import load_dataset

    try:
        return load_dataset(path, name=config_name, split=split, streaming=True)
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0]
        raise DataError(
            fields.name,
            path,
            f"could not be opened as a Hugging Face dataset (split {split!r}): "
            f"{type(e).__name__}: {first} (offline runs, HF_DATASETS_OFFLINE=1, can only use "
            "local data or the local cache)",
            f"use a registered name ({', '.join(sorted(DATASETS))}) or set "
            f"{fields.path} to a local file or directory",
        ) from e


@dataclass(frozen=True)
class DatasetSpec:
    """A named dataset: how to open it and where it lives unless ``dataset_path`` says else."""

    # (path, split, the fields naming them) -> streaming dataset
    loader: Callable[[str, str, Fields], HFIterableDataset]
    default_path: str
    text_column: str = "text"


DATASETS: dict[str, DatasetSpec] = {
    "test_corpus": DatasetSpec(_load_local, "tests/assets/test_corpus"),
    "c4": DatasetSpec(lambda p, s, f: _load_hub(p, s, f, config_name="en"), "allenai/c4"),
}


def load_text_dataset(
    dataset: str, dataset_path: str | None = None, split: str = "train", fields: Fields = TRAINING
) -> tuple[HFIterableDataset, str]:
    """The streaming dataset for ``training.dataset`` / ``training.dataset_path`` and its text
    column. A registered name uses its loader (``dataset_path`` overrides its default
    location); otherwise ``dataset_path`` (or ``dataset`` itself, when it is an existing local
    path) is read as local files; any other name is a hub dataset id. Errors name ``fields``."""
    if dataset in DATASETS:
        spec = DATASETS[dataset]
        where = fields.naming(bool(dataset_path))
        return spec.loader(dataset_path or spec.default_path, split, where), spec.text_column
    if dataset_path:
        return _load_local(dataset_path, split, fields), "text"
    if resolve_repo_path(dataset).exists():
        return _load_local(dataset, split, fields.naming(False)), "text"
    _check_not_a_missing_path(dataset, fields)
    return _load_hub(dataset, split, fields), "text"


def _check_not_a_missing_path(dataset: str, fields: Fields) -> None:
    if dataset.startswith((".", "/", "~")) or _builder_for(Path(dataset)):
        raise DataError(
            fields.name,
            dataset,
            "looks like a local path but does not exist",
            f"fix the path, or use a registered dataset ({', '.join(sorted(DATASETS))})",
        )
