"""Helpers for the checkpoint tests: run the trainer with fault injection, read checkpoints."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from tests.launcher import run_ranks, start_ranks
from tests.parity import DEBUG_TOML, TINY, losses, read_jsonl

STEPS = 6
INTERVAL = 3


def ckpt_argv(*extra: str, steps: int = STEPS, interval: int = INTERVAL) -> list[str]:
    return [
        *TINY,
        "--training.steps",
        str(steps),
        "--checkpoint.enable",
        "--checkpoint.interval",
        str(interval),
        *extra,
    ]


def train_with_faults(
    argv: list[str],
    dump: str,
    sigterm_after_step: int | None = None,
    sigterm_rank: int = 0,
    kill_in_commit_of_step: int | None = None,
    kill_rank: int = 1,
) -> list[dict] | None:
    """Run the trainer on this (forked) rank, optionally sending this process SIGTERM after a
    given step (one rank only: the ranks must agree by themselves) or SIGKILL-ing it after the
    checkpoint files of a step are written but before they are committed."""
    from torchtitan.checkpoint.manager import CheckpointManager
    from torchtitan.train import main
    from torchtitan.training.trainer import Trainer

    rank = int(os.environ["RANK"])
    if sigterm_after_step is not None and rank == sigterm_rank:
        train_step = Trainer.train_step

        def train_step_then_signal(self: Trainer) -> Any:
            out = train_step(self)
            if self.step == sigterm_after_step:
                os.kill(os.getpid(), signal.SIGTERM)
            return out

        Trainer.train_step = train_step_then_signal  # type: ignore[method-assign]
    if kill_in_commit_of_step is not None and rank == kill_rank:
        commit = CheckpointManager._commit

        def commit_or_die(
            self: CheckpointManager, step: int, kind: str = "full", mine: Any = None
        ) -> None:
            if step == kill_in_commit_of_step:
                os.kill(os.getpid(), signal.SIGKILL)
            commit(self, step, kind, mine)

        CheckpointManager._commit = commit_or_die  # type: ignore[method-assign]
    rc = main(["--job.config_file", DEBUG_TOML, "--job.dump_folder", dump, *argv])
    assert rc == 0, f"train exited {rc}"
    path = Path(dump) / "metrics" / f"rank_{rank}.jsonl"
    return read_jsonl(path) if path.exists() else None


def run_until_rank_killed(world_size: int, *args: Any, timeout: float = 300.0) -> None:
    """Fork ``world_size`` ranks running ``train_with_faults(*args)``; once a rank dies of
    SIGKILL, SIGKILL the others too (what torchrun does when a worker dies)."""
    procs, _ = start_ranks(train_with_faults, world_size, args)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            codes = [p.exitcode for p in procs]
            if -signal.SIGKILL in codes or None not in codes:
                break
            time.sleep(0.2)
        codes = [p.exitcode for p in procs]
        assert -signal.SIGKILL in codes, f"no rank was killed (exit codes {codes})"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()


def fresh_metrics(dump: Path) -> None:
    """Drop the metrics of earlier runs in ``dump`` (the JSONL writer appends)."""
    shutil.rmtree(dump / "metrics", ignore_errors=True)


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def read_checkpoint(folder: Path) -> dict[str, Any]:
    """Every entry of a DCP checkpoint as full tensors / objects, with flattened keys."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ckpt.pt"
        dcp_to_torch_save(str(folder), str(out))
        return flatten(torch.load(out, weights_only=False))


def assert_checkpoints_identical(a: Path, b: Path, skip_prefixes: tuple[str, ...] = ()) -> int:
    """Bitwise equality of two checkpoints (tensors with torch.equal, the rest with ==).
    Returns the number of entries compared."""
    ca, cb = read_checkpoint(a), read_checkpoint(b)
    keys = {k for k in ca if not k.startswith(skip_prefixes)}
    assert keys == {k for k in cb if not k.startswith(skip_prefixes)}, set(ca) ^ set(cb)
    diffs = []
    for k in sorted(keys):
        x, y = ca[k], cb[k]
        if isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)):
                worst = (x.float() - y.float()).abs().max().item() if x.shape == y.shape else None
                diffs.append(f"{k}: max abs diff {worst}")
        elif x != y:
            diffs.append(f"{k}: {str(x)[:80]} != {str(y)[:80]}")
    assert not diffs, f"{a} and {b} differ in {len(diffs)} entries:\n" + "\n".join(diffs[:10])
    return len(keys)


def assert_bitwise_resume(tmp_path: Path, world: int, *extra: str) -> int:
    """6 steps == 3 + resume from step 3 + 3, bit for bit (losses, grad norms, checkpoint entries)."""
    argv = ckpt_argv(*extra)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    ref = run_ranks(train_with_faults, world, argv, str(straight), timeout=600)[0]
    shutil.copytree(straight / "checkpoint" / "step-3", resumed / "checkpoint" / "step-3")
    got = run_ranks(train_with_faults, world, argv, str(resumed), timeout=600)[0]
    assert ref is not None and got is not None, "rank 0 wrote no metrics"
    assert [m["step"] for m in got] == [4, 5, 6]
    assert losses(got) == losses(ref)[3:], (losses(got), losses(ref)[3:])
    assert [m["grad_norm"] for m in got] == [m["grad_norm"] for m in ref[3:]]
    return assert_checkpoints_identical(
        straight / "checkpoint" / "step-6", resumed / "checkpoint" / "step-6"
    )
