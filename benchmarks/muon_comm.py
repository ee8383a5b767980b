"""Optimizer-step time of AdamW against Muon under FSDP on CPU and gloo, and, within Muon, the
time of its all-to-alls against its Newton-Schulz compute (docs/optimizers.md, "Figures").

::

    OMP_NUM_THREADS=1 python benchmarks/muon_comm.py --ranks 2 --steps 3
    OMP_NUM_THREADS=1 python benchmarks/muon_comm.py --flavor 1B --layers 1 --steps 1

Forks ``--ranks`` processes (gloo, one thread each), builds the model of
``train_configs/debug_model.toml`` (``--flavor`` and ``--layers`` override its shape), shards
it with FSDP (``apply_fsdp``: one unit per block plus the root), gives every parameter a random
gradient and times ``optimizer.step()`` (after one untimed step that creates the state). Muon's
collectives are timed through ``CommStats.timed`` (``optim/muon_dist.py``): each is waited for,
so the time includes waiting for the slower rank. Prints, per optimizer, the per-step medians
of its slowest rank; FSDP's own all-gathers and reduce-scatters (the same for both) are not run.

On gloo, DTensor has no all-to-all and falls back to an all-gather and a chunk: each rank then
receives ``ranks - 1`` times its stacked shard each way, where the "MiB/rank" column gives
what the all-to-alls of NCCL move (``CommStats.bytes_sent``); the CPU times say nothing about
NCCL on GPUs.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from torchtitan.config.manager import parse_args
from torchtitan.distributed.data_parallel import apply_fsdp
from torchtitan.models import MODELS
from torchtitan.optim.optimizer import build_optimizer
from torchtitan.planner.estimator import model_args_for

CONFIG = "train_configs/debug_model.toml"


def _model(flavor: str | None, layers: int | None, ranks: int) -> tuple[torch.nn.Module, dict]:
    """The FSDP-sharded model and the names of its embedding and output (AdamW under Muon,
    passed to ``build_optimizer`` as the trainer does)."""
    argv = ["--job.config_file", CONFIG] + (["--model.flavor", flavor] if flavor else [])
    cfg = parse_args(argv)
    args = model_args_for(cfg)
    if layers:
        args = dataclasses.replace(args, n_layers=layers)
    torch.manual_seed(0)
    spec = MODELS[cfg.model.name]
    model = spec.build(args)
    plan = spec.parallel_plan(args)
    names = {"output": plan.tensor_parallel.output, "embedding": plan.embedding}
    mesh = init_device_mesh("cpu", (ranks,), mesh_dim_names=("dp_shard",))
    fp32 = torch.float32
    apply_fsdp(model, list(model.layers.values()), mesh, fp32, fp32, True)  # type: ignore[operator]
    return model, names


def _grads(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3


def _time_steps(model: torch.nn.Module, names: dict, name: str, steps: int) -> dict[str, float]:
    cfg = parse_args(["--job.config_file", CONFIG, "--optimizer.name", name])
    o = dataclasses.replace(cfg.optimizer, implementation="foreach", muon_ns_dtype="float32")
    opt = build_optimizer([model], o, **names)
    opt.step()  # creates the state
    comm = getattr(opt, "comm", None)
    step_s, comm_s, ns_s = [], [], []
    for _ in range(steps):
        if comm is not None:
            comm.timed, comm.comm_s, comm.ns_s = True, 0.0, 0.0
        dist.barrier()
        t0 = time.perf_counter()
        opt.step()
        step_s.append(time.perf_counter() - t0)
        comm_s.append(comm.comm_s if comm is not None else 0.0)
        ns_s.append(comm.ns_s if comm is not None else 0.0)
    bytes_sent = comm.bytes_sent // comm.steps if comm is not None else 0
    med = statistics.median
    return {"step": med(step_s), "comm": med(comm_s), "ns": med(ns_s), "bytes": bytes_sent}


def _rank(rank: int, a: argparse.Namespace, port: int, out: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHTITAN_DEVICE="cpu")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=a.ranks)
    model, names = _model(a.flavor, a.layers, a.ranks)
    _grads(model)
    res = {name: _time_steps(model, names, name, a.steps) for name in ("AdamW", "Muon")}
    n = sum(p.numel() for p in model.parameters())  # DTensors: the global sizes
    out.put((rank, res, n))
    dist.destroy_process_group()


def _table(results: list[dict], params: int, a: argparse.Namespace) -> str:
    """One row per optimizer: the figures of its slowest rank (ms per step)."""
    shape = f"{a.flavor or 'debugmodel'}" + (f", {a.layers} block(s)" if a.layers else "")
    rows = [
        f"{shape}, {params / 1e6:.1f} M parameters, FSDP {a.ranks} (gloo, 1 thread per rank)",
        "| optimizer | step ms | collectives ms | Newton-Schulz ms | rest ms | MiB/rank |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name in ("AdamW", "Muon"):
        r = max((res[name] for res in results), key=lambda x: x["step"])
        step, comm, ns = r["step"], r["comm"], r["ns"]
        rows.append(
            f"| {name} | {step * 1e3:.1f} | {comm * 1e3:.1f} | {ns * 1e3:.1f} | "
            f"{(step - comm - ns) * 1e3:.1f} | {r['bytes'] / 2**20:.2f} |"
        )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--flavor", default=None)
    ap.add_argument("--layers", type=int, default=None)
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, a, port, queue)) for r in range(a.ranks)]
    for p in procs:
        p.start()
    got = sorted((queue.get() for _ in procs), key=lambda x: x[0])
    for p in procs:
        p.join()
    print(_table([r for _, r, _ in got], got[0][2], a))


if __name__ == "__main__":
    main()
