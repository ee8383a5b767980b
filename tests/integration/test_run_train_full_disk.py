"""A full disk met through ``run_train.sh`` (docs/checkpoint.md, "A full disk"; docs/errors.md,
"Exit codes"): exit 4 reaches the shell through torchrun, every rank prints the same one line,
``step-2`` stays intact and no ``step-4.tmp`` is left.

The disk is the test-only fault hook (``TORCHTITAN_FAULT``, tools/fault_injection.py):
``full_disk`` (rank 1's checkpoint files of step 4 write half, then meet ENOSPC) or
``mkdir_error`` (rank 0 cannot create ``step-4.tmp``: ENOSPC, or EACCES; the other rank must
not wait for it at the next collective). Slow (a torchrun launch each, ~40 s on 2 cores); the
fast tier checks the same paths in-process (tests/distributed/test_checkpoint_full_disk.py).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.launcher import run_train_env
from torchtitan.checkpoint import storage

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--training.seq_len", "64", "--training.local_batch_size", "2"]
CKPT = ["--checkpoint.enable", "--checkpoint.interval", "2", "--training.steps", "4"]


def _run(tmp: Path, fault: str | None) -> subprocess.CompletedProcess[str]:
    env = run_train_env("all", drop=("TORCHTITAN_FAULT",))
    if fault is not None:
        env["TORCHTITAN_FAULT"] = fault
    cmd = [str(ROOT / "run_train.sh"), "--job.dump_folder", str(tmp / "out"), *SMALL, *CKPT]
    return subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=600)


def _rank_errors(out: str) -> dict[str, str]:
    """Each rank's ``checkpoint error:`` line (torchrun prefixes ``[rankN]:``)."""
    found: dict[str, str] = {}
    for line in out.splitlines():
        m = re.match(r"\[(rank\d)\]:checkpoint error: (.*)", line)
        if m:
            assert m.group(1) not in found, f"{m.group(1)} printed two lines: {line}"
            found[m.group(1)] = m.group(2)
    return found


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fault", "why"),
    [
        ("full_disk:rank=1,step=4", "the disk is full (No space left on device, errno 28)"),
        ("mkdir_error:step=4", "the disk is full (No space left on device, errno 28)"),
        ("mkdir_error:step=4,errno=13", "the write failed (Permission denied, errno 13)"),
    ],
)
def test_full_disk_exits_4_through_torchrun(tmp_path: Path, fault: str, why: str) -> None:
    proc = _run(tmp_path, fault)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 4, out[-4000:]
    assert "Traceback" not in out and "ChildFailedError" not in out, out[-4000:]
    ckpt = tmp_path / "out" / "checkpoint"
    errors = _rank_errors(out)
    assert sorted(errors) == ["rank0", "rank1"], out[-4000:]
    line = errors["rank0"]
    assert errors["rank1"] == line, errors
    assert line.startswith(f"saving step 4 to {ckpt / 'step-4.tmp'} failed: {why}"), line
    assert f"step-2 is intact in {ckpt}" in line, line
    # The launcher repeats one rank's line as its last word.
    assert proc.stderr.rstrip().splitlines()[-1].endswith(f"checkpoint error: {line}"), out[-2000:]
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-2"]
    assert storage.verify(ckpt / "step-2") is None
    if "errno=13" in fault:  # the documented fix: relaunch the same command; it resumes
        proc = _run(tmp_path, None)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        assert "resuming after step 2" in proc.stdout + proc.stderr
        assert sorted(p.name for p in ckpt.iterdir()) == ["step-2", "step-4"]
