"""``python -m torchtitan.launch [torchrun options] -m torchtitan.train [config args]``: torchrun
with exit codes a user can act on (``run_train.sh`` uses it; docs/errors.md, "Exit codes").

- 0: training finished, or a preemption signal (SIGTERM, SIGUSR1) was handled gracefully: every
  local rank saved its checkpoint and exited 0 (or had just finished). torchrun raises
  ``SignalException`` when it receives a signal (its elastic agent turns the signal into that
  exception, forwards the signal to the ranks, waits up to ``--shutdown-timeout`` for them and
  re-raises); here that ends in exit 0 when every local rank reported a clean end.
- 2: a rank stopped on a config or data error (the rank printed the one-line message; it is
  repeated here, without torchrun's ``ChildFailedError`` traceback).
- 4: a checkpoint could not be written (a full disk): its partial files were removed, the
  previous checkpoint is intact.
- 1: a rank failed otherwise (its traceback is in the rank's output).
- 128 + N: signal N arrived and some rank did not stop cleanly (e.g. checkpointing off).

Ranks report through files in ``$TORCHTITAN_LAUNCH_DIR`` (a temporary folder made here),
written by ``torchtitan.train``: ``stopped_<local rank>`` (holding the step) when the rank ends
cleanly, ``error_<local rank>`` with the message of a config/data error.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

LAUNCH_DIR_ENV = "TORCHTITAN_LAUNCH_DIR"


def report_stop(kind: str, text: str) -> None:
    """From a rank: record a clean end (``stopped``, the step) or an error message (``error``)
    for the launcher; a no-op when not started by it."""
    folder = os.environ.get(LAUNCH_DIR_ENV)
    if not folder:
        return
    rank = os.environ.get("LOCAL_RANK", "0")
    with contextlib.suppress(OSError):  # the launcher's folder is gone: nothing to report to
        (Path(folder) / f"{kind}_{rank}").write_text(text)


def _local_ranks(nproc: str) -> int | None:
    try:
        return int(nproc)
    except ValueError:
        return None  # "gpu", "auto", ...: count whatever reported


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="torchtitan-launch-"))
    os.environ[LAUNCH_DIR_ENV] = str(folder)
    try:
        run(args)
        return 0
    except SignalException as e:
        stopped = sorted(folder.glob("stopped_*"))
        expected = _local_ranks(str(args.nproc_per_node))
        if stopped and (expected is None or len(stopped) == expected):
            steps = sorted({p.read_text().strip() for p in stopped})
            print(
                f"launch: signal {e.sigval.name}: every rank stopped cleanly at step "
                f"{', '.join(steps)} (after saving a checkpoint there when checkpoint.enable "
                "is on); relaunch the same command to resume",
                file=sys.stderr,
            )
            return 0
        print(
            f"launch: signal {e.sigval.name}: {len(stopped)} of {expected} local ranks stopped "
            "gracefully (graceful stops need --checkpoint.enable); the others were killed",
            file=sys.stderr,
        )
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        aborted = sorted(folder.glob("aborted_*"))
        if aborted:  # a spike / non-finite policy gave up: a training failure, not bad input
            print(f"error: {aborted[0].read_text().strip()}", file=sys.stderr)
            return 3
        unwritten = sorted(folder.glob("writefail_*"))
        if unwritten:  # a checkpoint could not be written (full disk): the previous one is kept
            print(f"error: {unwritten[0].read_text().strip()}", file=sys.stderr)
            return 4
        errors = sorted(folder.glob("error_*"))
        if errors:
            print(f"error: {errors[0].read_text().strip()}", file=sys.stderr)
            return 2
        print(
            f"launch: rank {rank} failed with exit code {failure.exitcode} (its traceback is in "
            "its output above; LOG_RANK=all shows every rank)",
            file=sys.stderr,
        )
        return 1
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
