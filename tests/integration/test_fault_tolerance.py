"""Replica fault tolerance with torchft, end to end as users launch it (docs/fault_tolerance.md):
a lighthouse, one run_train.sh per replica group on CPU ranks with gloo, a replica group
SIGKILLed mid-run and relaunched; the survivors go on, the relaunched group fetches its state
live from a peer, and at the end its weights and optimizer state equal its peers' bitwise."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from tests.checkpoint_helpers import read_checkpoint
from tests.ft_helpers import RECOVERED, Lighthouse, Replica, wait_for

pytest.importorskip("torchft")

PACE = "slow:rank=0,seconds=0.15"  # rank 0 of each group sleeps before each batch: the kill lands mid-run


def _final_states(folders: list[Path]) -> list[dict]:
    states = [read_checkpoint(f) for f in folders]
    return [{k: v for k, v in s.items() if k.startswith(("model.", "optimizer."))} for s in states]


def _assert_bitwise_equal(states: list[dict]) -> int:
    import torch

    first = states[0]
    for other in states[1:]:
        assert set(other) == set(first)
        diff = [k for k in first if not _same(first[k], other[k], torch)]
        assert not diff, f"{len(diff)} entries differ, e.g. {diff[:5]}"
    return len(first)


def _same(a: object, b: object, torch: object) -> bool:
    if hasattr(a, "dtype"):
        return bool(a.dtype == b.dtype and torch.equal(a, b))  # type: ignore[attr-defined]
    return a == b


def _common_step(replicas: list[Replica], after: int) -> int:
    """The first checkpoint step after ``after`` that every group has saved (0: none yet); a
    group that received a step from a peer did not save it itself."""
    saved = [
        {int(p.name[5:]) for p in (r.folder / "checkpoint").glob("step-*[0-9]")} for r in replicas
    ]
    common = [s for s in set.intersection(*saved) if s > after]
    return min(common, default=0)


def _kill_and_rejoin(tmp_path: Path, groups: int, ngpu: int) -> dict[str, float | str]:
    """Kill the last group at its step 4, relaunch it at once (as a restart policy would);
    once it has recovered, the first checkpoint every group writes must be bitwise equal."""
    lighthouse = Lighthouse(tmp_path)
    args = ("--training.steps", "1000", "--checkpoint.enable", "--checkpoint.interval", "5")
    args += ("--fault_tolerance.timeout_seconds", "10")  # a quorum that still counted the dead
    replicas = [
        Replica(tmp_path, g, groups, ngpu, lighthouse.address, *args, fault=PACE)
        for g in range(groups)
    ]
    victim, survivors = replicas[-1], replicas[:-1]
    try:
        wait_for(lambda: victim.last_step() >= 4, 300, "the victim's step 4", replicas)
        at_kill = survivors[0].last_step()
        victim.sigkill()
        killed = time.monotonic()
        victim.start()
        wait_for(
            lambda: all(r.last_step() > at_kill + 1 for r in survivors),
            120,
            "the survivors' steps after the kill",
            replicas,
        )
        resumed_after = time.monotonic() - killed
        wait_for(
            lambda: RECOVERED.search(victim.log.read_text()) is not None, 300, "recovery", replicas
        )
        recovered = RECOVERED.findall(victim.log.read_text())
        after = int(recovered[0][0])  # the first checkpoint every group saved after it
        wait_for(lambda: _common_step(replicas, after) > 0, 300, "a common checkpoint", replicas)
        folders = [
            r.folder / "checkpoint" / f"step-{_common_step(replicas, after)}" for r in replicas
        ]
        survivor_curve = survivors[0].steps()  # (step, loss) of rank 0, in the order logged
        survivor_steps = [s for s, _ in survivor_curve]
    finally:
        for r in replicas:
            if r.proc.poll() is None:
                r.sigkill()
        lighthouse.kill()
    # the survivors never stopped: every step number from their first (a group that starts
    # after its peers' step 1 receives it) once, a step whose all-reduce met the dead group
    # discarded and run again
    first, last = min(survivor_steps), max(survivor_steps)
    assert sorted(set(survivor_steps)) == list(range(first, last + 1)) and last > at_kill + 1
    assert _assert_bitwise_equal(_final_states(folders)) > 10
    return {
        "survivor_steps_after_kill_s": resumed_after,
        "steps_redone": len(survivor_steps) - len(set(survivor_steps)),
        "recovered_at_step": float(recovered[0][0]),
        "recovery_s": float(recovered[0][1]),
        "relaunch_to_recovered_s": time.monotonic() - killed,
        "survivor_steps_completed": len(set(survivor_steps)),
        "survivor_loss_curve": " ".join(f"{s}:{loss:.3f}" for s, loss in survivor_curve),
    }


def test_replica_killed_and_relaunched_rejoins_bitwise(tmp_path: Path) -> None:
    """2 replica groups x 1 rank: the representative fast case."""
    numbers = _kill_and_rejoin(tmp_path, groups=2, ngpu=1)
    print(f"fault tolerance, 2 groups x 1 rank: {numbers}")


@pytest.mark.slow
def test_three_groups_of_two_ranks_kill_and_rejoin(tmp_path: Path) -> None:
    numbers = _kill_and_rejoin(tmp_path, groups=3, ngpu=2)
    print(f"fault tolerance, 3 groups x 2 ranks: {numbers}")


@pytest.mark.slow
def test_two_groups_lost_below_min_replicas_stop_cleanly(tmp_path: Path) -> None:
    """3 groups, min_replicas 2: two SIGKILLed at once; the survivor stops with one message
    (exit 3) after saving its last committed step."""
    lighthouse = Lighthouse(tmp_path, min_replicas=2)
    args = ("--training.steps", "1000", "--checkpoint.enable", "--checkpoint.interval", "1000")
    args += ("--fault_tolerance.min_replicas", "2", "--fault_tolerance.quorum_timeout_seconds", "5")
    args += ("--fault_tolerance.timeout_seconds", "10")
    replicas = [Replica(tmp_path, g, 3, 1, lighthouse.address, *args, fault=PACE) for g in range(3)]
    try:
        wait_for(lambda: all(r.last_step() >= 3 for r in replicas), 300, "step 3", replicas)
        for r in replicas[1:]:
            r.sigkill()
        survivor = replicas[0]
        assert survivor.wait(120) == 3, survivor.text()[-4000:]
    finally:
        for r in replicas:
            if r.proc.poll() is None:
                r.sigkill()
        lighthouse.kill()
    out = survivor.text()
    assert "training aborted: fault tolerance: fewer than fault_tolerance.min_replicas=2" in out
    saved = re.search(r"step (\d+), the last committed, is in the checkpoint folder", out)
    assert saved, out[-4000:]
    assert int(saved[1]) >= max(s for s, _ in survivor.steps())  # no committed step lost
    assert (survivor.folder / "checkpoint" / f"step-{saved[1]}").is_dir()


@pytest.mark.slow
def test_lighthouse_killed_and_restarted(tmp_path: Path) -> None:
    """The lighthouse dies and comes back on its address: both groups go on stepping."""
    lighthouse = Lighthouse(tmp_path)
    replicas = [
        Replica(tmp_path, g, 2, 1, lighthouse.address, "--training.steps", "1000", fault=PACE)
        for g in range(2)
    ]
    try:
        wait_for(lambda: all(r.last_step() >= 3 for r in replicas), 300, "step 3", replicas)
        lighthouse.kill()
        time.sleep(1.0)
        at_restart = [r.last_step() for r in replicas]
        lighthouse.restart()
        wait_for(
            lambda: all(r.last_step() >= s + 5 for r, s in zip(replicas, at_restart, strict=True)),
            180,
            "5 steps after the lighthouse restart",
            replicas,
        )
        assert all(r.proc.poll() is None for r in replicas)
    finally:
        for r in replicas:
            if r.proc.poll() is None:
                r.sigkill()
        lighthouse.kill()
