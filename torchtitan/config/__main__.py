"""``python -m torchtitan.config --job.config_file F [overrides]``.

Prints the resolved config as TOML and exits 0, or prints the error and exits 2.
``--world_size N`` validates for N ranks (default: $WORLD_SIZE or 1); ``--sources`` writes after
each value where it came from (default, which file, command line, parallelism.auto, derived:
docs/configs.md); ``--help`` lists every field. With ``--parallelism.auto`` the chosen layout is
applied and the line naming it goes to stderr.
"""

from __future__ import annotations

import sys

from torchtitan.config.compose import annotate
from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig
from torchtitan.config.manager import help_text, to_toml
from torchtitan.plan.auto import load_config
from torchtitan.plan.explain import explain
from torchtitan.preflight.validate import world_size_from_env


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(help_text())
        return 0
    world_size = world_size_from_env()
    if "--world_size" in argv:
        i = argv.index("--world_size")
        try:
            world_size = int(argv[i + 1])
        except (IndexError, ValueError):
            print("error: --world_size needs an integer", file=sys.stderr)
            return 2
        del argv[i : i + 2]
    show_sources = "--sources" in argv
    argv = [a for a in argv if a != "--sources"]
    try:
        cfg, sources, note = load_config(argv, world_size=world_size)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if note:
        print(note, file=sys.stderr)
    text = to_toml(cfg)
    print(annotate(text, cfg, JobConfig(), sources) if show_sources else text)
    if cfg.job.explain:
        print(explain(cfg, world_size))
    return 0


if __name__ == "__main__":
    sys.exit(main())
