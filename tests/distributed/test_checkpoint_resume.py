"""Tier 3: checkpoints on gloo ranks: bitwise resume, preemption, kill -9, async, resharding.

Every case compares against an uninterrupted run of 6 steps that checkpoints at steps 3 and 6
(``straight`` for FSDP 2, :func:`straight_run` for the other layouts): losses of the resumed
steps and the final checkpoint (model, optimizer, LR scheduler, data position, RNG) must be
bitwise identical under the same layout; across a change of layout or world size the
floating-point reduction order changes and losses must agree to 1e-5.
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
    read_checkpoint,
    run_until_rank_killed,
    train_with_faults,
)
from tests.launcher import run_ranks
from tests.parity import assert_losses_match, losses
from torchtitan.config.sections import CHECKPOINT_PARTS

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


# Layouts for bitwise resume and resharding: (world size, overrides). The global batch is 8
# sequences in every one, so all of them see the same data at every step.
PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "8"]
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "one process": (1, ["--training.local_batch_size", "8"]),
    "FSDP 2 x TP 2": (4, [*FSDP2, "--parallelism.tensor_parallel_degree", "2"]),
    "PP 2": (2, PP2),
    "PP 2 x FSDP 2": (4, [*PP2[:2], *FSDP2]),
    "TP 2": (2, ["--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2"]),
    "CP 2": (2, ["--training.local_batch_size", "8", "--parallelism.context_parallel_degree", "2"]),
}
_STRAIGHT: dict[str, tuple[list[dict], Path]] = {}


def straight_run(layout: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], Path]:
    """The uninterrupted 6-step run of ``layout`` (checkpoints at 3 and 6), once per session."""
    if layout not in _STRAIGHT:
        world, overrides = LAYOUTS[layout]
        dump = tmp_path_factory.mktemp("straight_" + layout.replace(" ", ""))
        metrics = _run(world, ckpt_argv(*overrides), dump)
        assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
        _STRAIGHT[layout] = (metrics, dump)
    return _STRAIGHT[layout]


def _resume_from(src: Path, layout: str, dump: Path) -> list[dict]:
    """Copy the step-3 checkpoint ``src`` into a fresh dump folder and train steps 4..6 there
    under ``layout``."""
    shutil.copytree(src, _ckpt(dump, 3))
    world, overrides = LAYOUTS[layout]
    resumed = _run(world, ckpt_argv(*overrides), dump)
    assert [m["step"] for m in resumed] == [4, 5, 6]
    return resumed


@pytest.mark.parametrize(
    "layout",
    [
        "one process",
        pytest.param("FSDP 2 x TP 2", marks=pytest.mark.slow),
        pytest.param("PP 2", marks=pytest.mark.slow),
        pytest.param("PP 2 x FSDP 2", marks=pytest.mark.slow),
        pytest.param("CP 2", marks=pytest.mark.slow),
    ],
)
def test_bitwise_resume(
    layout: str, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """6 straight steps == 3 steps + resume from step 3 + 3 steps, under ``layout``: the same
    losses and grad norms bit for bit, and an identical step-6 checkpoint (parameters,
    optimizer state, LR scheduler, data position, RNG of every rank)."""
    ref, ref_dump = straight_run(layout, tmp_path_factory)
    resumed = _resume_from(_ckpt(ref_dump, 3), layout, tmp_path)
    assert losses(resumed) == losses(ref)[3:], (losses(resumed), losses(ref)[3:])
    assert [m["grad_norm"] for m in resumed] == [m["grad_norm"] for m in ref[3:]]
    n = assert_checkpoints_identical(_ckpt(ref_dump, 6), _ckpt(tmp_path, 6))
    # the parts of a checkpoint without fault tolerance: none added (DiLoCo's is its own)
    parts = {k.split(".", 1)[0] for k in read_checkpoint(_ckpt(tmp_path, 6))}
    assert parts == set(CHECKPOINT_PARTS), parts
    print(f"{layout}: 3 steps + resume + 3 steps == 6 steps; {n} checkpoint entries identical")


@pytest.mark.slow
@pytest.mark.parametrize(
    "saved_by, loaded_by",
    [("FSDP 2 x TP 2", "TP 2"), ("FSDP 2", "PP 2")],
)
def test_reshard_across_layouts(
    saved_by: str,
    loaded_by: str,
    straight: tuple[list[dict], Path],
    tmp_path_factory: pytest.TempPathFactory,
    tmp_path: Path,
) -> None:
    """The step-3 checkpoint of one layout resumes under another whose data-parallel degree is
    1 instead of 2: steps 4..6 must match the uninterrupted run of the saving layout (to 1e-5:
    reduction orders differ). The data position carries over, or the losses would differ."""
    ref, ref_dump = straight if saved_by == "FSDP 2" else straight_run(saved_by, tmp_path_factory)
    resumed = _resume_from(_ckpt(ref_dump, 3), loaded_by, tmp_path)
    assert_losses_match(
        losses(ref)[3:], losses(resumed), rtol=1e-5, label=f"{saved_by} -> {loaded_by}"
    )
