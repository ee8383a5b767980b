"""``python -m torchtitan.launch [torchrun options] -m torchtitan.train [config args]``: torchrun
with exit codes a user can act on (``run_train.sh`` uses it; docs/errors.md, "Exit codes").

- 0: training finished, or a preemption signal (SIGTERM, SIGUSR1) was handled gracefully: every
  local rank saved its checkpoint and exited 0 (or had just finished). torchrun raises
  ``SignalException`` when it receives a signal (its elastic agent turns the signal into that
  exception, forwards the signal to the ranks, waits up to ``--shutdown-timeout`` seconds for
  them, kills the rest and re-raises); here that ends in exit 0 when every local rank reported a
  clean end.
- 2: a rank stopped on a config or data error (the rank printed the one-line message; it is
  repeated here, without torchrun's ``ChildFailedError`` traceback).
- 4: a checkpoint could not be written (a full disk): its partial files were removed, the
  previous checkpoint is intact.
- 1: a rank failed otherwise (its traceback is in the rank's output).
- 128 + N: signal N arrived and some rank did not stop cleanly (e.g. checkpointing off).

Options: torchrun's, plus ``--shutdown-timeout SECONDS`` on every torch of the window (default
$TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30, as torchrun's own). Where torchrun has the option (torch
2.13+) it is torchrun's; where it has not (torch 2.11) this launcher adds it and gives the agent
that timeout itself (``torch_compat.TORCHRUN_SHUTDOWN_TIMEOUT``; docs/checkpoint.md, "Preemption").

Ranks report through files in ``$TORCHTITAN_LAUNCH_DIR`` (a temporary folder made here),
written by ``torchtitan.train``: ``stopped_<local rank>`` (holding the step) when the rank ends
cleanly, ``error_<local rank>`` with the message of a config/data error.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

LAUNCH_DIR_ENV = "TORCHTITAN_LAUNCH_DIR"
# Options this launcher takes on every torch of the window, whether or not torchrun has them.
LAUNCH_OPTIONS = ("--shutdown-timeout", "--shutdown_timeout")


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


def parse_args(argv: list[str]) -> argparse.Namespace:
    """torchrun's options plus ours; ``shutdown_timeout`` is always a number of seconds >= 0."""
    from torch.distributed.argparse_util import env
    from torch.distributed.run import get_args_parser

    from torchtitan.tools import torch_compat

    parser = get_args_parser()
    parser.prog = "python -m torchtitan.launch"
    if not torch_compat.TORCHRUN_SHUTDOWN_TIMEOUT:
        parser.add_argument(
            *LAUNCH_OPTIONS,
            action=env,
            type=int,
            default=None,
            help="Seconds the ranks get to exit after a forwarded signal before SIGKILL "
            "(default: $TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30); torchtitan.launch's own option",
        )
    args = parser.parse_args(argv)
    if args.shutdown_timeout is None:
        value = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30")
        try:
            args.shutdown_timeout = int(value)
        except ValueError:
            parser.error(f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT = {value!r}: must be whole seconds")
    if args.shutdown_timeout < 0:
        parser.error(f"--shutdown-timeout {args.shutdown_timeout}: must be >= 0 seconds")
    return args


@contextlib.contextmanager
def agent_shutdown_timeout(seconds: int) -> Iterator[None]:
    """Make torchrun's agent give its ranks ``seconds`` to exit after a signal (or at the end).

    torch 2.13+ does it itself (``--shutdown-timeout``): nothing to do. torch 2.11's agent stops
    its ranks with ``PContext.close(death_sig)``, whose ``timeout`` defaults to 30 s and has no
    other setting; for the duration of the run it defaults to ``seconds`` instead.
    """
    from torchtitan.tools import torch_compat

    if torch_compat.TORCHRUN_SHUTDOWN_TIMEOUT:
        yield
        return
    from torch.distributed.elastic.multiprocessing.api import PContext

    close = PContext.close

    def close_after(self: PContext, death_sig: object = None, timeout: int = seconds) -> None:
        close(self, death_sig, timeout)  # type: ignore[arg-type]

    setattr(PContext, "close", close_after)  # noqa: B010 - a method, restored below
    try:
        yield
    finally:
        setattr(PContext, "close", close)  # noqa: B010


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    args = parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="torchtitan-launch-"))
    os.environ[LAUNCH_DIR_ENV] = str(folder)
    try:
        with agent_shutdown_timeout(args.shutdown_timeout):
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
