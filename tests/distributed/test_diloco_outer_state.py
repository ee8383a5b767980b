"""DiLoCo's outer state in the DCP checkpoint is resharded like the weights
(torchtitan/fault_tolerance/outer_state.py): saved by 2 FSDP ranks, where torchft's last synced
weights are local shards and the outer momentum a DTensor, and loaded by one process with no
sharding, it is the full tensor of every parameter, bit for bit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.launcher import free_port
from tests.unit.test_semi_sync import FT, _cfg, _diloco, _sync

pytest.importorskip("torchft")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 4))


def _rank(rank: int, port: int, folder: str, out: Any) -> None:
    """A spawned rank (a forked one hangs once torchft was imported in the parent process)."""
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank))
    os.environ.update(WORLD_SIZE="2", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    full = _save_sharded(folder)
    out.put((rank, {kind: {k: t.tolist() for k, t in d.items()} for kind, d in full.items()}))


def _save_sharded(folder: str) -> dict[str, dict[str, torch.Tensor]]:
    """One of 2 FSDP ranks: an outer step and inner steps under DiLoCo, then the ``diloco``
    part saved with DCP; returns its full tensors."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, distribute_tensor

    from torchtitan.fault_tolerance.outer_state import OuterState

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    model = _model()
    fully_shard(model, mesh=mesh)
    state = OuterState(_cfg(*FT, "--fault_tolerance.semi_sync", "diloco").fault_tolerance, [model])
    semi = _diloco(model, 0, state)

    def inner_steps(seed: int) -> None:  # the same moves on every rank, each its own shard
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                move = torch.randn(p.shape, generator=g) * 0.1
                p.add_(distribute_tensor(move, mesh, p.placements))

    inner_steps(1)
    _sync(semi)
    inner_steps(2)
    sd = state.state_dict()
    assert all(isinstance(t, DTensor) for d in sd.values() for t in d.values())
    dcp.save({"diloco": sd}, checkpoint_id=folder)
    full = {kind: {k: t.full_tensor() for k, t in d.items()} for kind, d in sd.items()}
    full["weights"] = {k: p.full_tensor() for k, p in model.named_parameters()}
    return full


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, on purpose
def test_outer_state_saved_by_fsdp_ranks_loads_unsharded(tmp_path: Path) -> None:
    import multiprocessing as mp

    import torch.distributed.checkpoint as dcp

    from torchtitan.fault_tolerance.outer_state import OuterState

    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, str(tmp_path), out)) for r in range(2)]
    try:
        for p in procs:
            p.start()
        saved = dict(out.get(timeout=300) for _ in procs)
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    full = {kind: {k: torch.tensor(t) for k, t in d.items()} for kind, d in saved[0].items()}
    model = _model()
    state = OuterState(_cfg(*FT, "--fault_tolerance.semi_sync", "diloco").fault_tolerance, [model])
    targets = {"diloco": state.state_dict()}
    dcp.load(targets, checkpoint_id=str(tmp_path), no_dist=True)
    state.load_state_dict(targets["diloco"])
    _diloco(model, 5, state)  # torchft's DiLoCo takes the loaded state
    got = state.state_dict()
    assert set(got["synced"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    for kind in ("synced", "momentum"):
        for key, t in full[kind].items():
            assert torch.equal(got[kind][key], t), (kind, key)
    # neither is trivial: momentum after an outer step, synced weights before the inner steps
    assert all(m.abs().sum() > 0 for m in full["momentum"].values())
    assert all(not torch.equal(t, full["weights"][k]) for k, t in full["synced"].items())
