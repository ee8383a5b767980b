"""Entry point: ``python -m torchtitan.train --job.config_file F [--section.field value ...]``."""

from __future__ import annotations

import os
import sys

from torchtitan.checkpoint.safety import CheckpointSafetyError
from torchtitan.checkpoint.trust import UntrustedCheckpointError
from torchtitan.checkpoint.write_errors import CheckpointWriteError
from torchtitan.config.errors import ConfigError
from torchtitan.config.manager import asked_for_help
from torchtitan.distributed.utils import destroy_distributed
from torchtitan.guards.spikes import TrainingAborted
from torchtitan.launch import report_stop
from torchtitan.planner.auto import load_config
from torchtitan.planner.explain import explain
from torchtitan.planner.fit import check_fit
from torchtitan.preflight.validate import world_size_from_env
from torchtitan.tools import startup
from torchtitan.tools.logging import init_logger
from torchtitan.training.posttrain import PosttrainTrainer
from torchtitan.training.trainer import Trainer


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    startup.mark("imports")
    if asked_for_help(argv):
        return 0
    try:
        # parse, choose the layout (--parallelism.auto), validate: before any process group
        cfg, _, auto_note = load_config(argv)
        if not cfg.job.explain:
            check_fit(cfg, world_size_from_env())  # this machine's memory (job.fit_check)
    except ConfigError as e:
        return config_error(e)
    startup.mark("preflight")
    if auto_note and int(os.environ.get("RANK", "0")) == 0:
        init_logger().info(auto_note)  # the trainer sets the rank prefix later
    if cfg.job.explain:  # the preflight plan, then exit: no process group, no training
        if int(os.environ.get("RANK", "0")) == 0:
            print(explain(cfg, world_size_from_env()))
        return 0

    try:
        # the post-training modes (docs/posttrain.md) build their own data and step
        trainer = (Trainer if cfg.training.mode == "lm" else PosttrainTrainer)(cfg)
    except ConfigError as e:  # bad data or files found while building (DataError, ...)
        destroy_distributed()
        return config_error(e)
    except CHECKPOINT_ERRORS as e:  # the checkpoint folder as configured (docs/checkpoint.md)
        destroy_distributed()
        return checkpoint_error(e)
    try:
        try:
            if cfg.checkpoint.create_seed_checkpoint:
                # One process, all degrees 1 (validated): save the initial weights, no training.
                assert trainer.checkpointer is not None
                trainer.checkpointer.save_seed()
            else:
                trainer.train()
        finally:
            trainer.close()  # commits a background save: its failure is handled below
    except ConfigError as e:  # e.g. a malformed record met in the middle of the data
        return config_error(e)
    except CHECKPOINT_ERRORS as e:  # e.g. a rollback to an untrusted checkpoint
        return checkpoint_error(e)
    except TrainingAborted as e:  # the spike / non-finite policies gave up (docs/errors.md)
        print(f"training aborted: {e}", file=sys.stderr)
        report_stop("aborted", f"rank {os.environ.get('RANK', '0')}: training aborted: {e}")
        return 3
    except CheckpointWriteError as e:  # a full disk: partial save removed, previous kept
        print(f"checkpoint error: {e}", file=sys.stderr)
        report_stop("writefail", f"rank {os.environ.get('RANK', '0')}: checkpoint error: {e}")
        return 4
    finally:
        destroy_distributed()
    # To the launcher: this rank ended cleanly (a signal that came at the very end, after the
    # last step, also ends here), at this step.
    report_stop("stopped", str(trainer.preempted_at or trainer.step))
    return 0


CHECKPOINT_ERRORS = (CheckpointSafetyError, UntrustedCheckpointError)


def checkpoint_error(e: Exception) -> int:
    """A checkpoint folder that resuming as configured would damage, or a file that is not
    trusted: one line and exit 2, like a config error."""
    print(f"checkpoint error: {e}", file=sys.stderr)
    report_stop("error", f"rank {os.environ.get('RANK', '0')}: checkpoint error: {e}")
    return 2


def config_error(e: ConfigError) -> int:
    """One line on stderr (and to the launcher), exit code 2: no traceback for bad input."""
    print(f"config error: {e}", file=sys.stderr)
    report_stop("error", f"rank {os.environ.get('RANK', '0')}: config error: {e}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
