"""Where a path a user names is found: the generic resolver every loader uses (tokenizers,
datasets, chat data, the test assets). A leaf: it imports only the standard library."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
"""The folder that holds the ``torchtitan`` package (the repository root in a checkout)."""


def resolve_repo_path(path: str | Path) -> Path:
    """``path`` as given if it exists (absolute, or relative to the working directory);
    otherwise, for a relative path, the same path under the repository root (the parent of the
    ``torchtitan`` package), so defaults like ``tests/assets/...`` work from any directory.
    Returns the original path when neither exists, so callers can report it."""
    p = Path(path).expanduser()
    if p.exists() or p.is_absolute():
        return p
    in_repo = REPO_ROOT / p
    return in_repo if in_repo.exists() else p
