"""Streaming Hugging Face import and export at 1, 2 and 4 ranks against the disk's bandwidth.

    python benchmarks/hf_io.py [--flavor 1B] [--ranks 1,2,4] [--dir /tmp] [--max-shard-gb 5]

Writes a synthetic bf16 Hugging Face checkpoint of a Llama 3 flavor once (sharded
``model-0000k-of-0000N.safetensors`` + index, random weights generated one tensor at a time),
measures the disk's sequential write and read bandwidth on a file as large as the checkpoint
(written with ``fsync``, then evicted from the page cache with ``posix_fadvise(DONTNEED)`` so
the read comes from the disk), then for each rank count forks that many gloo ranks which
import the checkpoint into ``Shard(0)`` DTensors over all ranks (FSDP's layout) with
``checkpoint/hf_io.py`` and export it again (streaming, to a second folder, then deleted). The
checkpoint's pages are evicted before every import. One JSON line per run: per-rank bytes read,
shard bytes, peak RSS (``ru_maxrss``) and its growth over the rank's RSS before the import,
wall time, GB/s and the ratio to the disk's read (import) or write (export) bandwidth.

Free disk and memory are checked first (``shutil.disk_usage``, ``MemAvailable``): when the
checkpoint and its export do not fit the disk with 10% to spare, or the ranks' shards (the
model once) plus 0.5 GiB per rank do not fit the available memory, a smaller flavor is used and
the line says so.
Everything written is deleted at the end (``--keep`` keeps the checkpoint).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import resource
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from torchtitan.checkpoint import hf_io
from torchtitan.convert import sharded_empty
from torchtitan.models import MODELS

FALLBACK = ["8B", "1B", "debugmodel"]


def _rss_mib() -> float:
    """This process's current resident set (VmRSS), MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def evict(path: Path) -> None:
    """Drop ``path``'s clean pages from the page cache (its next read comes from the disk)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def disk_bandwidth(folder: Path, nbytes: int, block: int = 64 << 20) -> dict[str, float]:
    """Sequential write (with fsync) and cold read of one ``nbytes`` file, GB/s."""
    path = folder / "bandwidth.bin"
    buf = os.urandom(block)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(max(1, nbytes // block)):
            f.write(buf)
        f.flush()
        os.fsync(f.fileno())
    written = path.stat().st_size
    write_s = time.perf_counter() - t0
    evict(path)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(block):
            pass
    read_s = time.perf_counter() - t0
    path.unlink()
    return {"disk_write_GBps": written / write_s / 1e9, "disk_read_GBps": written / read_s / 1e9}


def write_synthetic(flavor: str, out: Path, max_shard_bytes: int) -> tuple[Any, int]:
    """A random bf16 HF checkpoint of the llama3 ``flavor``; returns (args, bytes)."""
    spec = MODELS["llama3"]
    args = spec.flavors[flavor]
    adapter = spec.state_dict_adapter(args)
    with torch.device("meta"):
        meta = spec.build(args).state_dict()
    planned = [
        (hf, torch.bfloat16, tuple(w.shape))
        for k, v in meta.items()
        for hf, w in adapter.to_hf_one(k, v, check=False)
    ]
    files = hf_io._plan_files(planned, max_shard_bytes)
    names = [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    out.mkdir(parents=True, exist_ok=True)
    # a random 1M-value block tiled: random-looking bytes at disk speed (randn of a billion
    # values on one core takes minutes)
    block = (torch.randn(1 << 20, generator=torch.Generator().manual_seed(0)) * 0.02).bfloat16()
    for name, entries in zip(names, files):
        writer = hf_io.SafetensorsWriter(out / name, entries)
        for hf, dtype, shape in entries:
            n = math.prod(shape)
            writer.write(hf, block.repeat(-(-n // block.numel()))[:n].view(shape).to(dtype))
        writer.close()
    total = sum(hf_io._nbytes(d, s) for _, d, s in planned)
    hf_io._write_index(out, [{e[0]: n for f, n in zip(files, names) for e in f}], total)
    (out / "config.json").write_text(json.dumps(adapter.hf_config(torch.bfloat16)))
    return args, total


def _rank_main(rank: int, world: int, port: int, folder: str, flavor: str, queue: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        spec = MODELS["llama3"]
        args = spec.flavors[flavor]
        adapter = spec.state_dict_adapter(args)
        with torch.device("meta"):
            shapes = {
                k: (tuple(v.shape), torch.bfloat16)
                for k, v in spec.build(args).state_dict().items()
            }
        mesh = init_device_mesh("cpu", (world,)) if world > 1 else None
        rss0 = _rss_mib()
        sd = sharded_empty(shapes, mesh)
        shard = sum((t.to_local() if hasattr(t, "to_local") else t).nbytes for t in sd.values())
        dist.barrier()
        t0 = time.perf_counter()
        progress = hf_io.load_hf_state_dict(sd, adapter, Path(folder))
        dist.barrier()
        import_s = time.perf_counter() - t0
        peak_import = _peak_rss_mib()
        out = Path(folder + f".export{world}")
        t0 = time.perf_counter()
        written = hf_io.save_hf_streaming(sd, adapter, out)
        export_s = time.perf_counter() - t0
        queue.put(
            (
                rank,
                dict(
                    bytes_read=progress.done,
                    shard_bytes=shard,
                    import_s=import_s,
                    export_s=export_s,
                    bytes_written=written.done,
                    rss_before_MiB=rss0,
                    peak_rss_import_MiB=peak_import,
                    peak_rss_MiB=_peak_rss_mib(),
                ),
            )
        )
    finally:
        dist.destroy_process_group()


def run(world: int, folder: Path, flavor: str) -> list[dict]:
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, port, str(folder), flavor, queue))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=3600) for _ in procs)
    for p in procs:
        p.join()
    return [results[r] for r in range(world)]


def _mem_available() -> int:
    """The kernel's estimate of memory available without swapping (MemAvailable), bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 1 << 62  # not Linux: no limit known


def choose_flavor(wanted: str, folder: Path, max_ranks: int) -> tuple[str, str]:
    """The largest flavor from ``wanted`` down whose files fit the free disk and whose ranks
    fit the available memory, and why a smaller one was taken.

    Disk: the checkpoint and its export are on disk together (the bandwidth file is deleted
    before the first import), with 10% to spare. Memory: the ranks together hold the whole
    model once (bf16 shards) plus about 0.5 GiB each (the process and one tensor in flight).
    """
    free, avail = shutil.disk_usage(folder).free, _mem_available()
    order = FALLBACK[FALLBACK.index(wanted) :] if wanted in FALLBACK else [wanted, *FALLBACK[1:]]
    for flavor in order:
        ckpt = 2 * MODELS["llama3"].num_params(MODELS["llama3"].flavors[flavor])  # bf16
        disk_need, mem_need = 2 * ckpt * 1.1, ckpt + max_ranks * (1 << 29)
        if disk_need < free and mem_need < avail:
            if flavor == wanted:
                return flavor, ""
            return (
                flavor,
                f"{wanted} needs more than {free / 1e9:.0f} GB free disk or {avail / 1e9:.0f} GB memory",
            )
    raise SystemExit(f"{folder}: {free / 1e9:.1f} GB free is too little even for debugmodel")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--flavor", default="1B", help="a llama3 flavor (bf16)")
    p.add_argument("--ranks", default="1,2,4")
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    p.add_argument("--max-shard-gb", type=float, default=5.0)
    p.add_argument("--keep", action="store_true")
    a = p.parse_args(argv)
    ranks = [int(r) for r in a.ranks.split(",")]
    flavor, note = choose_flavor(a.flavor, a.dir, max(ranks))
    work = Path(tempfile.mkdtemp(prefix="hf_io_bench_", dir=a.dir))
    try:
        t0 = time.perf_counter()
        args, total = write_synthetic(flavor, work / "hf", int(a.max_shard_gb * 1e9))
        disk = disk_bandwidth(work, total)
        head = {
            "flavor": flavor,
            "scaled_down": note,
            "checkpoint_GB": round(total / 1e9, 3),
            "files": len(list((work / "hf").glob("*.safetensors"))),
            "synthetic_write_s": round(time.perf_counter() - t0, 1),
            **{k: round(v, 3) for k, v in disk.items()},
        }
        print(json.dumps(head), flush=True)
        for world in ranks:
            for f in (work / "hf").glob("*.safetensors"):
                evict(f)
            results = run(world, work / "hf", flavor)
            shutil.rmtree(work / f"hf.export{world}", ignore_errors=True)
            print(json.dumps(summary(world, results, total, disk)), flush=True)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def summary(world: int, results: list[dict], total: int, disk: dict[str, float]) -> dict:
    import_s = max(r["import_s"] for r in results)
    export_s = max(r["export_s"] for r in results)
    read = sum(r["bytes_read"] for r in results)
    import_rate = read / import_s / 1e9
    export_rate = total / export_s / 1e9
    return {
        "ranks": world,
        "per_rank_read_GB": [round(r["bytes_read"] / 1e9, 3) for r in results],
        "max_read_over_share": round(max(r["bytes_read"] for r in results) / (total / world), 3),
        "per_rank_shard_GB": [round(r["shard_bytes"] / 1e9, 3) for r in results],
        "peak_rss_import_MiB": [round(r["peak_rss_import_MiB"]) for r in results],
        "rss_growth_import_MiB": [
            round(r["peak_rss_import_MiB"] - r["rss_before_MiB"]) for r in results
        ],
        "peak_rss_MiB": [round(r["peak_rss_MiB"]) for r in results],
        "import_s": round(import_s, 2),
        "import_GBps": round(import_rate, 3),
        "import_vs_disk_read": round(import_rate / disk["disk_read_GBps"], 2),
        "export_s": round(export_s, 2),
        "export_GBps": round(export_rate, 3),
        "export_vs_disk_write": round(export_rate / disk["disk_write_GBps"], 2),
        "per_rank_written_GB": [round(r["bytes_written"] / 1e9, 3) for r in results],
    }


if __name__ == "__main__":
    sys.exit(main())
