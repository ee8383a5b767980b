"""``python -m torchtitan.config --job.config_file F [overrides]``.

Prints the resolved config as TOML and exits 0, or prints the error and exits 2. The job must
also fit this machine's memory (``job.fit_check``, ``torchtitan/plan/fit.py``).
``--world_size N`` validates for N ranks (default: $WORLD_SIZE or 1); ``--help`` lists every field.
"""

from __future__ import annotations

import logging
import sys

from torchtitan.config.errors import ConfigError
from torchtitan.config.manager import help_text, to_toml
from torchtitan.plan.explain import explain
from torchtitan.plan.fit import check_fit
from torchtitan.preflight.validate import load_config, parse_world_size, world_size_from_env
from torchtitan.tools.logging import logger


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(help_text())
        return 0
    # The checks' warnings go to stderr as "warning: ..." (stdout is the TOML, which
    # run_train.sh discards).
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("warning: %(message)s"))
    logger.addHandler(handler)
    try:
        return _run(argv)
    finally:
        logger.removeHandler(handler)


def _run(argv: list[str]) -> int:
    try:
        world_size = world_size_from_env()
        if "--world_size" in argv:
            i = argv.index("--world_size")
            world_size = parse_world_size(argv[i + 1] if i + 1 < len(argv) else "")
            del argv[i : i + 2]
        cfg = load_config(argv, world_size=world_size)
        if not cfg.job.explain:  # explain reports the estimate against the device instead
            check_fit(cfg, world_size)  # the memory of this machine (docs/planning.md)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(to_toml(cfg))
    if cfg.job.explain:
        print(explain(cfg, world_size))
    return 0


if __name__ == "__main__":
    sys.exit(main())
