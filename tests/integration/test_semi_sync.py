"""Semi-synchronous replica groups (torchft's LocalSGD / DiLoCo; docs/fault_tolerance.md).

``test_synced_every_step_equals_fault_tolerant_data_parallel``: two replica groups, each its
own process with its own store and torchft Manager, joined over gloo through an in-process
lighthouse, drive ``ReplicaGroup`` as the trainer does (start_step, forward/backward on the
group's own data, reduce_and_commit, the optimizer step, after_update). Synced every step,
LocalSGD (parameter averaging) and DiLoCo with outer lr 1 and momentum 0 (the last synced
weights minus the mean pseudo-gradient) are data parallel whenever the inner update is linear in
the gradient: SGD with momentum here (Adam's is not linear, so the equality does not hold for
it). Without the averaging the groups' weights would differ by ~lr x |g_a - g_b|, orders of
magnitude over the 1e-6 tolerance (checked).

``test_bytes_per_step_fall_by_the_interval`` (slow): the measured run of the docs, as users
launch it (run_train.sh per group): the bytes each rank all-reduces across the groups per step
(``ft/bytes_per_step``) fall by sync_every, and the loss after N steps against synchronous."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
from pathlib import Path
from typing import Any

import pytest

from tests.launcher import free_port

pytest.importorskip("torchft")

STEPS, DIM = 5, 16


def _group(mode: str, replica_id: int, lighthouse: str, out: Any) -> None:
    """One replica group of one rank: STEPS steps of SGD with momentum on a linear model, the
    group's own data (seeded by its id); puts (losses, final weights, bytes sent) on ``out``."""
    import torch

    from torchtitan.config.sections import FaultTolerance
    from torchtitan.fault_tolerance.replica import ReplicaGroup

    os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(free_port()))
    os.environ.update(RANK="0", WORLD_SIZE="1")
    store = torch.distributed.TCPStore(  # noqa: F841 (the group's store, kept alive)
        "localhost", int(os.environ["MASTER_PORT"]), is_master=True, wait_for_workers=False
    )
    torch.manual_seed(0)  # the same initial weights in every group
    model = torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.Tanh(), torch.nn.Linear(DIM, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    semi = {"plain": {}, "local_sgd": {"semi_sync": "local_sgd"}}.get(mode)
    if semi is None:
        semi = {"semi_sync": "diloco", "outer_lr": 1.0, "outer_momentum": 0.0}
    ft = FaultTolerance(
        enable=True, replica_id=replica_id, group_size=2, lighthouse=lighthouse,
        min_replicas=2, timeout_seconds=30, quorum_timeout_seconds=30, **semi,  # type: ignore[arg-type]
    )  # fmt: skip
    group = ReplicaGroup(ft, [model], opt, sched, None, lambda: None, 0, torch.device("cpu"))
    data = torch.Generator().manual_seed(100 + replica_id)  # each group's own batches
    losses, step = [], 0
    try:
        while step < STEPS:
            step = group.start_step(step) + 1
            opt.zero_grad()
            x = torch.randn(8, DIM, generator=data)
            loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
            loss.backward()
            if not group.reduce_and_commit(list(model.parameters())):
                continue
            opt.step()
            sched.step()
            group.after_update(step)
            losses.append(loss.item())
        weights = [p.detach().double().tolist() for p in model.parameters()]  # no shared memory
        out.put((replica_id, losses, weights, group.bytes_sent))
    finally:
        group.close()


def _run(mode: str) -> list[tuple[list[float], list[Any], int]]:
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_group, args=(mode, g, lighthouse.address(), out)) for g in range(2)
    ]
    try:
        for p in procs:
            p.start()
        results = sorted(out.get(timeout=120) for _ in procs)
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0, (mode, p.exitcode)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        lighthouse.shutdown()
    import torch

    return [(losses, [torch.tensor(w) for w in ws], sent) for _, losses, ws, sent in results]


def _max_diff(a: list[Any], b: list[Any]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def test_synced_every_step_equals_fault_tolerant_data_parallel() -> None:
    plain = _run("plain")
    reference = plain[0][1]
    assert _max_diff(reference, plain[1][1]) == 0.0  # data parallel: the groups agree
    assert plain[0][0] != plain[1][0]  # on their own data
    numel_bytes = sum(w.numel() * 4 for w in reference)  # fp32
    assert plain[0][2] == STEPS * numel_bytes  # one gradient all-reduce per step
    for mode in ("local_sgd", "diloco"):
        groups = _run(mode)
        for group, (losses, weights, sent) in enumerate(groups):
            assert len(losses) == STEPS
            for want, got in zip(plain[group][0], losses, strict=True):
                assert abs(want - got) <= 1e-6, (mode, group, plain[group][0], losses)
            assert _max_diff(reference, weights) <= 1e-6, (mode, _max_diff(reference, weights))
            assert sent == STEPS * numel_bytes  # parameters or pseudo-gradients, every step
    # the tolerance is meaningful: with no averaging, a group's own run ends far away
    alone = _run_alone()
    assert _max_diff(reference, alone) > 1e-3


def _run_alone() -> list[Any]:
    """Group 0's weights after the same steps with no other group (its own data only)."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.Tanh(), torch.nn.Linear(DIM, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    data = torch.Generator().manual_seed(100)
    for _ in range(STEPS):
        opt.zero_grad()
        x = torch.randn(8, DIM, generator=data)
        ((model(x) - x.sum(1, keepdim=True)) ** 2).mean().backward()
        opt.step()
        sched.step()
    return [p.detach().double() for p in model.parameters()]


def _records(folder: Path) -> list[dict]:
    lines = (folder / "metrics" / "rank_0.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _launch(tmp_path: Path, name: str, steps: int, *args: str) -> list[Path]:
    """Two replica groups of one rank through run_train.sh for ``steps`` steps; their dump
    folders (``tmp_path/name/replica<g>``, which may hold checkpoints to resume from)."""
    from tests.ft_helpers import Lighthouse, Replica

    folder = tmp_path / name
    folder.mkdir(exist_ok=True)
    lighthouse = Lighthouse(folder, min_replicas=2)  # both groups from step 1
    run_args = ("--training.steps", str(steps), "--fault_tolerance.min_replicas", "2", *args)
    replicas = [Replica(folder, g, 2, 1, lighthouse.address, *run_args) for g in range(2)]
    try:
        for r in replicas:
            assert r.wait(600) == 0, r.text()[-4000:]
    finally:
        for r in replicas:
            if r.proc.poll() is None:
                r.sigkill()
        lighthouse.kill()
    return [r.folder for r in replicas]


@pytest.mark.slow
def test_bytes_per_step_fall_by_the_interval(tmp_path: Path) -> None:
    """debugmodel, 2 groups x 1 rank, 40 steps: synchronous, DiLoCo and LocalSGD every 4."""
    steps, every = 40, 4
    runs = {
        "synchronous": _launch(tmp_path, "sync", steps),
        "diloco": _launch(
            tmp_path,
            "diloco",
            steps,
            "--fault_tolerance.semi_sync",
            "diloco",
            "--fault_tolerance.sync_every",
            str(every),
        ),  # fmt: skip
        "local_sgd": _launch(
            tmp_path,
            "local_sgd",
            steps,
            "--fault_tolerance.semi_sync",
            "local_sgd",
            "--fault_tolerance.sync_every",
            str(every),
        ),  # fmt: skip
    }
    found = {}
    for name, folders in runs.items():
        records = _records(folders[0])
        assert [r["step"] for r in records] == list(range(1, steps + 1))  # every step here
        tail = [r["loss"] for r in records[-5:]]
        found[name] = (records[-1]["ft/bytes_total"] / steps, sum(tail) / len(tail))
    print(f"semi-sync, 2 groups x 1 rank, {steps} steps: (bytes/step, loss last 5): {found}")
    sync_bytes = found["synchronous"][0]
    for name in ("diloco", "local_sgd"):
        assert found[name][0] == sync_bytes / every, (name, found)
        assert found[name][1] < found["synchronous"][1] + 1.0  # it trains (numbers in docs)


@pytest.mark.slow
def test_diloco_resume_restores_the_outer_state_bitwise(tmp_path: Path) -> None:
    """DiLoCo every 2 steps, 2 groups x 1 rank, a checkpoint every step: 5 straight steps ==
    resumed from the step-2 checkpoint (a sync step) and from the step-3 one (mid-interval:
    the last synced weights are step 2's, one inner step taken since), every checkpoint entry
    (model, inner optimizer, DiLoCo's last synced weights and outer momentum, data position,
    RNG) bitwise, in both groups."""
    import shutil

    import torch

    from tests.checkpoint_helpers import assert_checkpoints_identical, read_checkpoint

    args = ("--checkpoint.enable", "--checkpoint.interval", "1", "--fault_tolerance.semi_sync")
    args += ("diloco", "--fault_tolerance.sync_every", "2")
    straight = _launch(tmp_path, "straight", 5, *args)
    at3 = read_checkpoint(straight[0] / "checkpoint" / "step-3")
    model = {k[6:]: v for k, v in at3.items() if k.startswith("model.")}
    synced = {k[14:]: v for k, v in at3.items() if k.startswith("diloco.synced.")}
    momentum = [v for k, v in at3.items() if k.startswith("diloco.momentum.")]
    assert set(synced) == set(model) and len(momentum) == len(model)  # under the same names
    assert all(v.abs().sum() > 0 for v in momentum)  # the outer step of step 2
    assert any(not torch.equal(synced[k], model[k]) for k in model)  # step 2's, not step 3's
    for start, compared in ((2, (4, 5)), (3, (5,))):
        name = f"from{start}"
        for g, src in enumerate(straight):
            dst = tmp_path / name / f"replica{g}" / "checkpoint" / f"step-{start}"
            shutil.copytree(src / "checkpoint" / f"step-{start}", dst)
        resumed = _launch(tmp_path, name, 5, *args)
        for a, b in zip(straight, resumed, strict=True):
            for step in compared:
                ckpt = Path("checkpoint") / f"step-{step}"
                assert assert_checkpoints_identical(a / ckpt, b / ckpt) > 3 * len(model)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["diloco", "local_sgd"])
def test_group_killed_and_relaunched_rejoins(mode: str, tmp_path: Path) -> None:
    """DiLoCo or LocalSGD every 2 steps, 2 groups x 1 rank: the last group is SIGKILLed at its
    step 4 and relaunched; the survivor goes on; the relaunched group receives its peer's
    state at a sync's quorum, and at the next checkpoint both (a sync step) hold the same
    weights bitwise (the inner optimizers' moments are each group's own, so only the model is
    compared)."""
    import torch

    from tests.checkpoint_helpers import read_checkpoint
    from tests.ft_helpers import RECOVERED, Lighthouse, Replica, wait_for
    from tests.integration.test_fault_tolerance import PACE, _common_step

    lighthouse = Lighthouse(tmp_path)
    args = ("--training.steps", "1000", "--checkpoint.enable", "--checkpoint.interval", "4")
    args += ("--fault_tolerance.timeout_seconds", "10", "--fault_tolerance.semi_sync", mode)
    args += ("--fault_tolerance.sync_every", "2")
    replicas = [Replica(tmp_path, g, 2, 1, lighthouse.address, *args, fault=PACE) for g in range(2)]
    victim, survivor = replicas[1], replicas[0]
    try:
        wait_for(lambda: victim.last_step() >= 4, 300, "the victim's step 4", replicas)
        at_kill = survivor.last_step()
        victim.sigkill()
        victim.start()
        wait_for(lambda: survivor.last_step() > at_kill + 2, 120, "survivor steps", replicas)
        wait_for(
            lambda: RECOVERED.search(victim.log.read_text()) is not None, 300, "recovery", replicas
        )
        recovered = RECOVERED.findall(victim.log.read_text())[0]
        after = int(recovered[0])
        wait_for(lambda: _common_step(replicas, after) > 0, 300, "a common checkpoint", replicas)
        step = _common_step(replicas, after)
    finally:
        for r in replicas:
            if r.proc.poll() is None:
                r.sigkill()
        lighthouse.kill()
    states = [read_checkpoint(r.folder / "checkpoint" / f"step-{step}") for r in replicas]
    kept = ("model.", "diloco.")  # and DiLoCo's outer state, which a recovery hands over too
    models = [{k: v for k, v in s.items() if k.startswith(kept)} for s in states]
    assert set(models[0]) == set(models[1]) and len(models[0]) > 10
    assert any(k.startswith("diloco.") for k in models[0]) == (mode == "diloco")
    assert all(torch.equal(models[0][k], models[1][k]) for k in models[0]), step
    print(f"{mode}: recovered at step {after} in {recovered[1]} s; step-{step} checkpoints equal")
