"""Render every config field (name, type, default, docstring) as Markdown: docs/config.md.

``python -m torchtitan.config.docs > docs/config.md`` regenerates it; a test fails when the file
and the dataclasses disagree, so every new option is a deliberate, documented decision.
"""

from __future__ import annotations

from torchtitan.config.manager import iter_fields, type_name

HEADER = """# Configuration reference

Generated from the field docstrings in `torchtitan/config/job_config.py` and `sections.py` by
`python -m torchtitan.config.docs > docs/config.md`; a test keeps the two in sync.

Set a field in a TOML file under its section (`[training]` then `steps = 100`; nested sections as
`[quantize.dense.float8]`) or on the command line as `--training.steps 100` or
`--training.steps=100`. Booleans are bare flags (`--compile.enable`) and are turned off with
`--no-compile.enable` or `--compile.enable=false`; lists are comma-separated
(`--parallelism.pipeline_parallel_split_points layers.4,layers.8`). The command line overrides
the TOML files, which override the defaults. A TOML file may extend a base (`extends =
"base.toml"`) and several files apply in order (`--job.config_file a.toml,b.toml`): see
docs/configs.md. `python -m torchtitan.config --job.config_file F [overrides] [--world_size N]
[--sources]` prints the resolved config (with `--sources`, where each value came from), or the
first error with exit code 2.
"""


def _md(text: str) -> str:
    return text.replace("|", "\\|")


def config_markdown() -> str:
    lines = [HEADER]
    section = None
    for path, tp, default, doc in iter_fields():
        sec = path.rsplit(".", 1)[0]
        if sec != section:
            lines += [
                "",
                f"## [{sec}]",
                "",
                "| field | type | default | description |",
                "|---|---|---|---|",
            ]
            section = sec
        name = path.rsplit(".", 1)[1]
        lines.append(f"| `{name}` | {_md(type_name(tp))} | `{default!r}` | {_md(doc)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(config_markdown(), end="")
