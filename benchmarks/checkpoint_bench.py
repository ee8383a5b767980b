"""Checkpoint save/load times and async overlap, one process, CPU or GPU.

    python benchmarks/checkpoint_bench.py [--flavors debug,large] [--steps 4] [--repeat 3]
    python benchmarks/checkpoint_bench.py --flavors "" --dcp-flavor 1B [--dcp-threads 1,2]

For each model (``debug``: the debug model; ``large``: the same with dim 1024 and 8 layers)
it builds the model and AdamW state, then measures with the real CheckpointManager:
a synchronous save, a load, an async save's blocking part (staging a CPU copy), its
background write (timed to the end of the training step during which it finished), its commit
at the next step boundary (SHA-256 of the files, manifest, rename: blocking), and the training
step time with and without a background write in flight
(the overlap). Each measurement is repeated ``--repeat`` times; the JSON line per model gives
the median (and the min/max under ``*_range``), since a shared machine is noisy. Also prints
``uptime``'s load average at the start and the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from torchtitan.checkpoint.manager import CheckpointManager
from torchtitan.models.llama3.args import LLAMA3_FLAVORS
from torchtitan.models.llama3.model import Transformer

FLAVORS = {
    "debug": LLAMA3_FLAVORS["debugmodel"],
    "large": dataclasses.replace(LLAMA3_FLAVORS["debugmodel"], dim=1024, n_layers=8),
}


class _NoData:
    def state_dict(self) -> dict:
        return {"dp_rank_0": b"", "dp_world_size": 1}

    def load_state_dict(self, sd: dict) -> None:
        pass


def _summary(xs: list[float]) -> tuple[float, list[float]]:
    return round(statistics.median(xs), 3), [round(min(xs), 3), round(max(xs), 3)]


def bench(name: str, steps: int, repeat: int, seq_len: int = 64, batch: int = 4) -> dict:
    args = dataclasses.replace(FLAVORS[name], max_seq_len=seq_len)
    model = Transformer(args)
    model.init_weights(seed=0)  # type: ignore[operator]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    tokens = torch.randint(0, args.vocab_size, (batch, seq_len + 1))

    def train_step() -> float:
        t0 = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t0

    train_step()  # optimizer state exists from here on
    with tempfile.TemporaryDirectory() as tmp:

        def manager(mode: str) -> CheckpointManager:
            return CheckpointManager(
                root=Path(tmp) / mode,
                interval=10**9,
                keep_latest_k=0,
                async_mode=mode,  # type: ignore[arg-type]
                load_step=-1,
                total_steps=10**9,
                model_parts=[model],
                optimizer=opt,
                lr_scheduler=sched,
                dataloader=_NoData(),
            )

        sync = manager("disabled")
        saves, loads = [], []
        for r in range(repeat):
            t0 = time.perf_counter()
            sync.save(r + 1, 0)
            saves.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            sync.load()  # the newest: step r + 1, checksums verified
            loads.append(time.perf_counter() - t0)
        size = sum(f.stat().st_size for f in (Path(tmp) / "disabled" / "step-1").iterdir())
        sync.close()

        plain = [train_step() for _ in range(steps)]
        asy = manager("async")
        blocking, writes, commits, overlapped = [], [], [], []
        for r in range(repeat):
            t0 = time.perf_counter()
            asy.save(r + 1, 0)
            blocking.append(time.perf_counter() - t0)
            assert asy._pending is not None
            while not asy._pending[1].done():
                overlapped.append(train_step())
            writes.append(time.perf_counter() - t0 - blocking[-1])
            t0 = time.perf_counter()
            asy._finish_pending()  # at the next step boundary: digest own files, commit
            commits.append(time.perf_counter() - t0)
        asy.close()
    save_s, save_range = _summary(saves)
    load_s, load_range = _summary(loads)
    blocking_s, blocking_range = _summary(blocking)
    write_s, write_range = _summary(writes)
    commit_s, commit_range = _summary(commits)
    return {
        "model": name,
        "params": sum(p.numel() for p in model.parameters()),
        "checkpoint_MB": round(size / 2**20, 1),
        "repeat": repeat,
        "sync_save_s": save_s,
        "sync_save_s_range": save_range,
        "load_s": load_s,
        "load_s_range": load_range,
        "async_blocking_s": blocking_s,
        "async_blocking_s_range": blocking_range,
        "async_background_write_s": write_s,
        "async_background_write_s_range": write_range,
        "async_commit_s": commit_s,
        "async_commit_s_range": commit_range,
        "steps_overlapped": len(overlapped),
        "step_s_plain": round(statistics.median(plain), 4),
        "step_s_during_async_write": round(statistics.median(overlapped), 4)
        if overlapped
        else None,
        "threads": torch.get_num_threads(),
    }


def dcp_vs_disk(flavor: str, folder: Path, threads: int) -> dict:
    """Model-only DCP save and load of a llama3 ``flavor`` in bf16 (one process) against the
    disk's sequential bandwidth measured here on a file of the same size (benchmarks/hf_io.py:
    fsync, then the pages evicted so the read comes from the disk); plus the manifest's
    SHA-256 pass (save) and verification (load) the CheckpointManager adds."""
    import math

    import torch.distributed.checkpoint as dcp

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.hf_io import disk_bandwidth, evict
    from torchtitan.checkpoint import storage
    from torchtitan.models import MODELS

    spec = MODELS["llama3"]
    with torch.device("meta"):
        shapes = {
            k: tuple(v.shape) for k, v in spec.build(spec.flavors[flavor]).state_dict().items()
        }
    block = torch.randn(1 << 20).bfloat16()
    sd = {}
    for k, shape in shapes.items():
        n = math.prod(shape)
        sd[k] = block.repeat(-(-n // block.numel()))[:n].view(shape).clone()
    nbytes = sum(t.nbytes for t in sd.values())
    disk = disk_bandwidth(folder, nbytes)
    out = folder / "dcp"
    writer = dcp.FileSystemWriter(str(out), thread_count=threads, sync_files=True)
    t0 = time.perf_counter()
    dcp.save({"model": sd}, storage_writer=writer, no_dist=True)
    save_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    storage.digest_files(out, None)
    digest_s = time.perf_counter() - t0
    for f in out.iterdir():
        evict(f)
    back = {k: torch.empty_like(v) for k, v in sd.items()}
    t0 = time.perf_counter()
    dcp.load({"model": back}, storage_reader=dcp.FileSystemReader(str(out)), no_dist=True)
    load_s = time.perf_counter() - t0
    shutil.rmtree(out)
    assert all(torch.equal(back[k], sd[k]) for k in sd)
    return {
        "flavor": flavor,
        "GB": round(nbytes / 1e9, 3),
        "threads": threads,
        **{k: round(v, 3) for k, v in disk.items()},
        "dcp_save_GBps": round(nbytes / save_s / 1e9, 3),
        "dcp_save_vs_disk_write": round(nbytes / save_s / 1e9 / disk["disk_write_GBps"], 2),
        "dcp_load_cold_GBps": round(nbytes / load_s / 1e9, 3),
        "dcp_load_vs_disk_read": round(nbytes / load_s / 1e9 / disk["disk_read_GBps"], 2),
        "manifest_sha256_GBps": round(nbytes / digest_s / 1e9, 3),
    }


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--flavors", default="debug,large")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dcp-flavor", default="", help="also: DCP vs disk for this llama3 flavor")
    p.add_argument("--dcp-threads", default="1,2", help="FileSystemWriter thread counts")
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    a = p.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    try:
        print(json.dumps({"uptime_start": _uptime()}), flush=True)
        for name in filter(None, a.flavors.split(",")):
            print(json.dumps(bench(name, a.steps, a.repeat)), flush=True)
        for threads in map(int, a.dcp_threads.split(",") if a.dcp_flavor else []):
            with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
                print(json.dumps(dcp_vs_disk(a.dcp_flavor, Path(tmp), threads)), flush=True)
        print(json.dumps({"uptime_end": _uptime()}), flush=True)
    finally:
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
