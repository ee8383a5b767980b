"""Tier 3: Muon's timed collectives (``CommStats.timed``, used by benchmarks/muon_comm.py) change
nothing in the result, on 2 gloo ranks, and count what they time (docs/optimizers.md)."""

from __future__ import annotations

import torch

from tests.launcher import run_ranks

SHAPES = [(64, 32), (64, 32), (64, 32), (32, 96)]  # a bucket of 3 (padded to 4) and one of 1


def _orthogonalise_both_ways() -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from torchtitan.optim.muon import newton_schulz
    from torchtitan.optim.muon_dist import CommStats, orthogonalize

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    torch.manual_seed(0)  # the same full matrices on both ranks
    full = [torch.randn(s) for s in SHAPES]
    updates = [distribute_tensor(t, mesh, [Shard(0)]) for t in full]

    def ns(x: torch.Tensor) -> torch.Tensor:
        return newton_schulz(x, 5, torch.float32)

    plain, timed = CommStats(), CommStats(timed=True)
    a = orthogonalize(updates, ns, torch.float32, plain)
    b = orthogonalize(updates, ns, torch.float32, timed)
    out = {
        "same": all(torch.equal(x.to_local(), y.to_local()) for x, y in zip(a, b)),
        "bytes": (plain.bytes_sent, timed.bytes_sent),
        "untimed_s": (plain.comm_s, plain.ns_s),
        "timed_s": (timed.comm_s, timed.ns_s),
        "max_err": max((x.full_tensor() - ns(t)).abs().max().item() for x, t in zip(b, full)),
    }
    dist.destroy_process_group()
    return out


def test_timed_collectives_change_nothing_and_are_counted() -> None:
    for r in run_ranks(_orthogonalise_both_ways, 2):
        assert r["same"]
        # all-to-all accounting: 2 (W - 1) / W of the stacked shard per bucket, W = 2
        shard = 4 * (4 * 32 * 32 + 2 * 16 * 96)  # fp32 bytes: 4 padded [32, 32] + 2 [16, 96]
        assert r["bytes"] == (shard, shard)
        assert r["untimed_s"][0] == 0.0  # collectives only timed when asked
        assert r["timed_s"][0] > 0.0 and r["timed_s"][1] > 0.0
        assert r["max_err"] < 1e-5  # whole-matrix Newton-Schulz, as on one process
