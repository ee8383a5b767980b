"""Render every family's ``config.json`` key table (``models/<family>/hf_keys.py``) into the
"Config keys" section of docs/hf_io.md.

``python -m torchtitan.models.hf_keys_doc`` rewrites the section between its two markers in
place; a test fails when the page and the tables disagree, so a new key is a deliberate,
documented decision.
"""

from __future__ import annotations

import sys
from pathlib import Path

from torchtitan.models import MODELS

BEGIN, END = "<!-- hf-keys:begin (generated) -->", "<!-- hf-keys:end -->"
DOC = Path(__file__).resolve().parents[2] / "docs" / "hf_io.md"


def keys_markdown() -> str:
    """The generated section: one table per family in ``MODELS`` order."""
    lines = [BEGIN, ""]
    for name, spec in MODELS.items():
        hf = getattr(spec, "hf", None)
        table = None if hf is None else hf.config.keys
        if table is None:
            continue
        lines += [f"### {name}", "", *table.markdown(), ""]
    return "\n".join([*lines, END])


def render(page: str) -> str:
    """``page`` with its generated section replaced by :func:`keys_markdown`."""
    start, end = page.index(BEGIN), page.index(END) + len(END)
    return page[:start] + keys_markdown() + page[end:]


if __name__ == "__main__":
    DOC.write_text(render(DOC.read_text()))
    sys.exit(0)
