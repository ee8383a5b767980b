"""Tier 3: checkpoints on gloo ranks: bitwise resume, preemption, kill -9, async, resharding.

Every case compares against one uninterrupted FSDP 2 run of 6 steps that checkpoints at steps
3 and 6 (``straight``): losses of the resumed steps and the final checkpoint (model, optimizer,
LR scheduler, data position, RNG) must be bitwise identical, except across a change of world
size where floating-point reduction order changes and losses must agree to 1e-5.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.checkpoint_helpers import (
    STEPS,
    assert_checkpoints_identical,
    ckpt_argv,
    fresh_metrics,
    run_until_rank_killed,
    train_with_faults,
)
from tests.launcher import run_ranks
from tests.parity import assert_losses_match, losses

FSDP2 = ["--training.local_batch_size", "4"]
FSDP4 = ["--training.local_batch_size", "2"]


def _run(world: int, argv: list[str], dump: Path, **faults: object) -> list[dict]:
    # A generous timeout: CI machines shared with other suites can be very slow.
    results = run_ranks(train_with_faults, world, argv, str(dump), *faults.values(), timeout=600)
    assert results[0] is not None, "rank 0 wrote no metrics"
    return results[0]


def _sigterm(after_step: int, rank: int) -> dict[str, object]:
    return {"sigterm_after_step": after_step, "sigterm_rank": rank}


def _ckpt(dump: Path, step: int) -> Path:
    return dump / "checkpoint" / f"step-{step}"


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], Path]:
    dump = tmp_path_factory.mktemp("straight")
    metrics = _run(2, ckpt_argv(*FSDP2), dump)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert _ckpt(dump, 3).is_dir() and _ckpt(dump, 6).is_dir()
    return metrics, dump


def test_sigterm_saves_and_exits_then_bitwise_resume(
    straight: tuple[list[dict], Path], tmp_path: Path
) -> None:
    """SIGTERM reaches only rank 1 after step 2: both ranks save step 2 and exit 0; the
    resumed run's steps 3..6 and final checkpoint equal the uninterrupted run's bitwise."""
    ref, ref_dump = straight
    first = _run(2, ckpt_argv(*FSDP2), tmp_path, **_sigterm(2, rank=1))
    assert [m["step"] for m in first] == [1, 2], "the run did not stop after step 2"
    assert _ckpt(tmp_path, 2).is_dir(), "no checkpoint saved on SIGTERM"
    assert losses(first) == losses(ref)[:2]
    fresh_metrics(tmp_path)
    resumed = _run(2, ckpt_argv(*FSDP2), tmp_path)
    assert [m["step"] for m in resumed] == [3, 4, 5, 6]
    assert losses(resumed) == losses(ref)[2:], (losses(resumed), losses(ref)[2:])
    assert [m["grad_norm"] for m in resumed] == [m["grad_norm"] for m in ref[2:]]
    n = assert_checkpoints_identical(_ckpt(ref_dump, 6), _ckpt(tmp_path, 6))
    print(f"FSDP 2: 2 steps + SIGTERM + resume + 4 steps == 6 steps; {n} entries identical")


def test_kill9_during_save_resumes_from_previous_checkpoint(
    straight: tuple[list[dict], Path], tmp_path: Path
) -> None:
    """Rank 1 is SIGKILLed after writing its step-6 files but before the commit; the restart
    ignores the unfinished step-6.tmp, resumes from step 3 and reproduces steps 4..6."""
    ref, ref_dump = straight
    run_until_rank_killed(
        2, ckpt_argv(*FSDP2), str(tmp_path), None, 0, STEPS, 1
    )  # train_with_faults(argv, dump, sigterm_after_step, sigterm_rank, kill_step, kill_rank)
    root = tmp_path / "checkpoint"
    assert (root / "step-6.tmp").is_dir() and not (root / "step-6").exists()
    assert _ckpt(tmp_path, 3).is_dir()
    fresh_metrics(tmp_path)
    resumed = _run(2, ckpt_argv(*FSDP2), tmp_path)
    assert [m["step"] for m in resumed] == [4, 5, 6]
    assert losses(resumed) == losses(ref)[3:]
    assert_checkpoints_identical(_ckpt(ref_dump, 6), _ckpt(tmp_path, 6))
    assert not (root / "step-6.tmp").exists(), "the unfinished save was not cleaned up"


def test_async_save_matches_sync(straight: tuple[list[dict], Path], tmp_path: Path) -> None:
    """The step-3 checkpoint is written by a background thread while steps 4..6 train; it
    must be bitwise identical to the synchronous one (and training unchanged)."""
    ref, ref_dump = straight
    got = _run(2, ckpt_argv(*FSDP2, "--checkpoint.async_mode", "async"), tmp_path)
    assert losses(got) == losses(ref)
    for step in (3, 6):
        assert_checkpoints_identical(_ckpt(ref_dump, step), _ckpt(tmp_path, step))


@pytest.mark.slow
def test_reshard_fsdp4_to_fsdp2(straight: tuple[list[dict], Path], tmp_path: Path) -> None:
    """A checkpoint saved by FSDP 4 (preempted after step 3) resumes on FSDP 2; the data
    position carries over, so steps 4..6 match the uninterrupted FSDP 2 run (to 1e-5:
    the reduction order differs between 4 and 2 ranks)."""
    ref, _ = straight
    first = _run(4, ckpt_argv(*FSDP4), tmp_path, **_sigterm(3, rank=2))
    assert [m["step"] for m in first] == [1, 2, 3]
    fresh_metrics(tmp_path)
    resumed = _run(2, ckpt_argv(*FSDP2), tmp_path)
    assert [m["step"] for m in resumed] == [4, 5, 6]
    assert_losses_match(losses(ref)[3:], losses(resumed), rtol=1e-5, label="FSDP 4 -> FSDP 2")


def test_single_process_bitwise_resume(tmp_path: Path) -> None:
    """One process: 6 straight steps == 3 steps + resume from step 3 + 3 steps."""
    straight_dump, resumed_dump = tmp_path / "straight", tmp_path / "resumed"
    ref = _run(1, ckpt_argv("--training.local_batch_size", "8"), straight_dump)
    shutil.copytree(_ckpt(straight_dump, 3), _ckpt(resumed_dump, 3))
    resumed = _run(1, ckpt_argv("--training.local_batch_size", "8"), resumed_dump)
    assert [m["step"] for m in resumed] == [4, 5, 6]
    assert losses(resumed) == losses(ref)[3:]
    assert_checkpoints_identical(_ckpt(straight_dump, 6), _ckpt(resumed_dump, 6))
