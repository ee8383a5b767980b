"""Entry point: ``python -m torchtitan.train --job.config_file F [--section.field value ...]``."""

from __future__ import annotations

import os
import sys

from torchtitan.config.errors import ConfigError
from torchtitan.config.manager import help_text
from torchtitan.distributed.utils import destroy_distributed
from torchtitan.plan.explain import explain
from torchtitan.preflight.validate import load_config, world_size_from_env
from torchtitan.trainer import Trainer


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(help_text())
        return 0
    try:
        cfg = load_config(argv)  # parse and validate, before any process group
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if cfg.job.explain:  # the preflight plan, then exit: no process group, no training
        if int(os.environ.get("RANK", "0")) == 0:
            print(explain(cfg, world_size_from_env()))
        return 0

    trainer = Trainer(cfg)
    try:
        if cfg.checkpoint.create_seed_checkpoint:
            # One process, all degrees 1 (validated): save the initial weights, no training.
            assert trainer.checkpointer is not None
            trainer.checkpointer.save_seed()
        else:
            trainer.train()
    finally:
        trainer.close()
        destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
