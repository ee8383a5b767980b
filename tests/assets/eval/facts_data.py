"""Written by scripts/make_eval_tasks.py (docs/evaluation.md): the tasks' ``custom_dataset``.

lm-eval calls it with the YAML's ``dataset_kwargs`` (and ``metadata``); the ``data_files``
named relative to the YAML are read from this folder, so stock
``lm_eval --include_path tests/assets/eval`` works from any working directory (absolute
names, as torchtitan passes them, are kept).
"""

from pathlib import Path
from typing import Any


def load(data_files: dict[str, str], **_: Any) -> Any:
    import datasets

    here = Path(__file__).resolve().parent
    files = {split: str(here / name) for split, name in data_files.items()}
    return datasets.load_dataset("json", data_files=files)
