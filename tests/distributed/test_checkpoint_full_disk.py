"""Tier 3: a save that meets a full disk (ENOSPC) on 2 ranks (docs/checkpoint.md, "A full disk").

The disk is a write hook: from the save of step 4 on, DCP's file streams on rank 1 write half of
what they are given and raise ``OSError(ENOSPC)`` (a partial file stays behind, as on a real full
disk), or rank 0's manifest write does. (A real small tmpfs works too where ``mount -t tmpfs`` is
allowed; the hook runs everywhere.) For a blocking save, a background one
(``checkpoint.async_mode async``) and the manifest: exit 4 with one line on every rank, no
``step-4.tmp`` left, ``step-2`` byte-identical and resumable.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.checkpoint_helpers import ckpt_argv
from tests.launcher import run_ranks
from tests.parity import DEBUG_TOML
from torchtitan.tools.fault_injection import _HalfWrite  # the fault hooks' half-writing stream

FULL_FROM_STEP = 4
LOCAL = ("--training.local_batch_size", "4")  # x 2 ranks = the global batch of 8


def _install_full_disk(where: str) -> None:
    """From step ``FULL_FROM_STEP`` on: rank 1's data files (``data``) or rank 0's manifest
    (``manifest``) cannot be written."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    from torchtitan.checkpoint import storage

    def full(path: Any) -> bool:
        return any(f"step-{s}.tmp" in str(path) for s in range(FULL_FROM_STEP, 100))

    rank = int(os.environ["RANK"])
    if where == "data" and rank == 1:
        create_stream = FileSystem.create_stream

        @contextlib.contextmanager
        def create_or_fill(self: Any, path: Any, mode: str) -> Iterator[Any]:
            with create_stream(self, path, mode) as stream:
                yield _HalfWrite(stream) if "w" in mode and full(path) else stream

        FileSystem.create_stream = create_or_fill  # type: ignore[method-assign]
    if where == "manifest" and rank == 0:
        commit = storage.commit

        def commit_or_fill(root: Path, step: int, *args: Any, **kwargs: Any) -> Path:
            if step >= FULL_FROM_STEP:
                (storage.tmp_dir(root, step) / storage.MANIFEST).write_text('{"form')
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return commit(root, step, *args, **kwargs)

        storage.commit = commit_or_fill  # type: ignore[assignment]


def _main(dump: Path, *argv: str) -> str:
    from torchtitan.distributed.utils import destroy_distributed
    from torchtitan.train import main

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            rc = main(["--job.config_file", DEBUG_TOML, "--job.dump_folder", str(dump), *argv])
        return f"rc {rc}: {err.getvalue().strip()}"
    except BaseException as e:  # noqa: BLE001 - the message is the result
        return f"{type(e).__name__}: {e}"
    finally:
        destroy_distributed()


def _run(tmp: str, phase: str, where: str, async_mode: str) -> dict[str, Any]:
    """One phase on fresh ranks: ``first`` (checkpoint step 2), ``full`` (the disk fills from
    step 4 on) or ``resume`` (from step 2, without the hook, to step 3)."""
    from torchtitan.checkpoint import storage

    ckpt = Path(tmp) / "run" / "checkpoint"
    extra = ("--checkpoint.async_mode", async_mode, *LOCAL)
    # Async: step 4's background write fails, found at step 5 (the last step saves blocking).
    steps = {"first": 2, "full": 5 if async_mode == "async" else 4, "resume": 3}[phase]
    if phase == "full":
        _install_full_disk(where)
    out = {"main": _main(Path(tmp) / "run", *ckpt_argv(*extra, steps=steps, interval=2))}
    out["left"] = sorted(p.name for p in ckpt.iterdir())
    out["step2"] = (ckpt / "step-2" / storage.MANIFEST).read_bytes()
    out["step2_valid"] = storage.verify(ckpt / "step-2")
    return out


@pytest.mark.parametrize(
    ("where", "async_mode"),
    [
        ("data", "disabled"),
        pytest.param("data", "async", marks=pytest.mark.slow),
        pytest.param("manifest", "disabled", marks=pytest.mark.slow),
    ],
)
def test_full_disk_keeps_the_previous_checkpoint(
    tmp_path: Path, where: str, async_mode: str
) -> None:
    first = run_ranks(_run, 2, str(tmp_path), "first", where, async_mode)
    assert [r["main"] for r in first] == ["rc 0: ", "rc 0: "], first
    full = run_ranks(_run, 2, str(tmp_path), "full", where, async_mode)
    for rank, out in enumerate(full):
        rc, _, line = out["main"].partition(": ")
        assert rc == "rc 4", (rank, out["main"])
        assert len(line.splitlines()) == 1, line
        assert line.startswith("checkpoint error: saving step 4 to "), line
        assert "the disk is full (No space left on device, errno 28)" in line, line
        assert "its partial files were removed and step-2 is intact" in line, line
        assert out["left"] == ["step-2"], out["left"]
        assert out["step2"] == first[0]["step2"] and out["step2_valid"] is None, out
    # The previous checkpoint still loads: a resume from it trains on to step 3.
    resumed = run_ranks(_run, 2, str(tmp_path), "resume", where, "disabled")
    assert [r["main"] for r in resumed] == ["rc 0: ", "rc 0: "], resumed
    assert resumed[0]["left"] == ["step-2", "step-3"]


def _make_folders(tmp: str, fault: str) -> list[str]:
    """Steps 2 and 4's folders on this rank under ``fault`` (rank 0's mkdir fails from step 4):
    what each call did, or the one line it raised."""
    import torch.distributed as dist

    from torchtitan.checkpoint.write_errors import CheckpointWriteError, make_step_folder
    from torchtitan.tools.fault_injection import parse_faults

    dist.init_process_group("gloo")
    root, rank = Path(tmp) / "checkpoint", dist.get_rank()
    faults = parse_faults(rank, fault)
    out = []
    for step in (2, 4):
        try:
            made = make_step_folder(root, step, rank, dist.group.WORLD, faults)
            out.append(f"made {made.name}: {made.is_dir()}")
        except CheckpointWriteError as e:
            out.append(str(e))
    dist.barrier()  # no rank is left behind in a collective
    return out


@pytest.mark.parametrize("code", [28, 13])
def test_rank0_mkdir_failure_reaches_every_rank(tmp_path: Path, code: int) -> None:
    """Rank 0 cannot create ``step-4.tmp`` (ENOSPC, EACCES): the other rank does not wait for
    it at the next collective; both raise the same one line (``train`` prints it, exit 4;
    through ``run_train.sh``: tests/integration/test_run_train_full_disk.py)."""
    results = run_ranks(_make_folders, 2, str(tmp_path), f"mkdir_error:step=4,errno={code}")
    assert results[0] == results[1], results
    assert results[0][0] == "made step-2.tmp: True"
    line = results[0][1]
    assert len(line.splitlines()) == 1 and line.startswith("saving step 4 to "), line
    assert f"errno {code}" in line and "step-4.tmp failed" in line, line
    want_fix = "free space there" if code == 28 else f"make {tmp_path / 'checkpoint'} writable"
    assert want_fix in line, line
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-2.tmp"]
