"""``python -m torchtitan.config --job.config_file F [overrides]``.

Prints the resolved config as TOML and exits 0, or prints the error and exits 2. This validates
the config for any machine (a cluster's layout checks on a laptop); ``--launch`` says this
machine is about to run it, and adds the fit check against its memory (``job.fit_check``,
``torchtitan/planner/fit.py``): ``run_train.sh`` passes it, and ``torchtitan.train`` runs the same
check on every rank. ``--world_size N`` validates for N ranks (default: $WORLD_SIZE or 1); ``--sources`` writes after
each value where it came from (default, which file, command line, parallelism.auto, derived:
docs/configs.md); ``--help`` lists every field. With ``--parallelism.auto`` the chosen layout is
applied and the line naming it goes to stderr.
"""

from __future__ import annotations

import logging
import sys

from torchtitan.config.compose import annotate
from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig
from torchtitan.config.manager import asked_for_help, to_toml
from torchtitan.planner.auto import load_config
from torchtitan.planner.explain import explain
from torchtitan.planner.fit import check_fit
from torchtitan.preflight.validate import parse_world_size, world_size_from_env
from torchtitan.tools.logging import logger


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if asked_for_help(argv):
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
    show_sources, launch = "--sources" in argv, "--launch" in argv
    argv = [a for a in argv if a not in ("--sources", "--launch")]
    try:
        world_size = world_size_from_env()
        if "--world_size" in argv:
            i = argv.index("--world_size")
            world_size = parse_world_size(argv[i + 1] if i + 1 < len(argv) else "")
            del argv[i : i + 2]
        cfg, sources, note = load_config(argv, world_size=world_size)
        if launch and not cfg.job.explain:  # explain reports the estimate against the device
            check_fit(cfg, world_size)  # the memory of this machine (docs/planning.md)
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
