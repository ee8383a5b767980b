"""A save that cannot be written (a full disk, a quota, an I/O error): remove its partial files,
keep the previous checkpoint, end the run with one line (exit 4; docs/checkpoint.md, "A full
disk", and docs/errors.md, "Exit codes").

A failed DCP write raises ``CheckpointException`` on every rank (DCP gathers each rank's write
result and shares the failures), for a blocking save at ``dcp.save`` and for an asynchronous one
at its future; a failed manifest write on rank 0 is shared by ``CheckpointManager._commit``. So
every rank enters :func:`remove_partial_on_write_error` together, waits for the others, and
rank 0 deletes ``step-N.tmp``; nothing else under the checkpoint folder is touched. A failed
creation of ``step-N.tmp`` on rank 0 (before anything is written) is shared by
:func:`make_step_folder`, and every rank raises the same one line.
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist

from torchtitan.checkpoint import storage as io
from torchtitan.tools.fault_injection import Faults

FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
DENIED = {errno.EACCES, errno.EPERM, errno.EROFS}


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written; its partial folder is removed, the previous one is
    intact. ``torchtitan.train`` prints it as one line and exits 4."""


def os_error_in(e: BaseException) -> OSError | None:
    """The ``OSError`` behind ``e``: itself, its cause or context, or the first one DCP
    collected from a rank (``CheckpointException.failures``)."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [e]
    while todo:
        cur = todo.pop(0)
        if cur is None or id(cur) in seen:
            continue
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno is not None:
            return cur
        failures = getattr(cur, "failures", None)
        if isinstance(failures, dict):
            for value in failures.values():
                todo.append(value[0] if isinstance(value, tuple) else value)
        todo += [cur.__cause__, cur.__context__]
    return None


def describe(root: Path, step: int, err: OSError) -> str:
    """The one line: what failed, what was cleaned up, what is still there, what to do."""
    kept = [s for s in io.complete_steps(root) if s != step]
    previous = f"step-{kept[-1]} is intact" if kept else "there is no previous checkpoint"
    why = "the disk is full" if err.errno in FULL else "the write failed"
    fix = (
        f"make {root} writable (or point job.dump_folder at a writable disk)"
        if err.errno in DENIED
        else "free space there (or lower checkpoint.keep_latest_k, or point job.dump_folder "
        "at a larger disk)"
    )
    return (
        f"saving step {step} to {io.tmp_dir(root, step)} failed: {why} "
        f"({err.strerror or err}, errno {err.errno}); its partial files were removed and "
        f"{previous} in {root}. Fix: {fix} and relaunch the same command to resume"
    )


def make_step_folder(
    root: Path, step: int, rank: int, pg: dist.ProcessGroup | None, faults: Faults
) -> Path:
    """Rank 0 (re)creates ``step-N.tmp``. Its ``OSError`` (a full disk, no permission) is
    broadcast, so every rank raises ``CheckpointWriteError`` together instead of waiting for
    rank 0 at the next collective; the broadcast also holds the other ranks until the folder
    exists."""
    tmp = io.tmp_dir(root, step)
    failed: list[OSError | None] = [None]
    if rank == 0:
        try:
            if tmp.exists():
                shutil.rmtree(tmp)
            faults.before_checkpoint_mkdir(step)  # test-only (tools/fault_injection.py)
            tmp.mkdir(parents=True)
        except OSError as e:
            failed[0] = e
            shutil.rmtree(tmp, ignore_errors=True)
    if pg is not None and dist.get_world_size(pg) > 1:
        dist.broadcast_object_list(failed, src=0, group=pg)
    if failed[0] is not None:
        raise CheckpointWriteError(describe(root, step, failed[0]))
    return tmp


@contextmanager
def remove_partial_on_write_error(
    root: Path, step: int, rank: int, pg: dist.ProcessGroup | None
) -> Iterator[None]:
    """Run a save of ``step``; on an ``OSError`` (every rank raises together), rank 0 removes
    ``step-N.tmp`` once all ranks have stopped writing, and every rank raises
    ``CheckpointWriteError``. Any other failure propagates unchanged."""
    try:
        yield
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        err = os_error_in(e)
        if err is None or isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        together = pg is not None and dist.get_world_size(pg) > 1
        if together:  # every rank has stopped writing
            dist.barrier(group=pg)
        if rank == 0:
            shutil.rmtree(io.tmp_dir(root, step), ignore_errors=True)
        if together:  # ... and every rank returns after the removal
            dist.barrier(group=pg)
        raise CheckpointWriteError(describe(root, step, err)) from None
