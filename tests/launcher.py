"""A small multi-process launcher for tier-3 tests: fork N ranks on gloo, collect their results.

Workers are forked from the (already imported) pytest process, so start-up costs ~0.1 s instead
of a fresh interpreter per rank. Each worker gets torchrun's environment variables on a free
port, ``TORCHTITAN_DEVICE=cpu`` (CPU and gloo even where CUDA is visible), one intra-op thread,
and returns a picklable result (or the formatted traceback).

CUDA cannot be used in a child forked after the parent initialised it, so once CUDA is
initialised in this process (a ``gpu`` test ran) the ranks are spawned instead: slower, and
``fn`` and its arguments must then be picklable (module-level functions are).
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import queue as queue_module
import socket
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_train_env(log_rank: str = "0", drop: tuple[str, ...] = ()) -> dict[str, str]:
    """The environment the tests launch ``run_train.sh`` in: 2 CPU ranks on this interpreter,
    ``LOG_RANK`` as given, this process's variables but ``drop``."""
    env = {k: v for k, v in os.environ.items() if k not in drop}
    return dict(env, NGPU="2", LOG_RANK=log_rank, TORCHTITAN_PYTHON=sys.executable)


def run_train_sh(dump: Path, *args: str, log_rank: str = "0") -> str:
    """``run_train.sh --job.dump_folder dump *args`` on 2 CPU ranks (cwd ``dump``); must exit 0."""
    env = run_train_env(log_rank)
    cmd = [str(ROOT / "run_train.sh"), "--job.dump_folder", str(dump), *args]
    proc = subprocess.run(cmd, cwd=dump, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out


def mp_context() -> Any:
    """fork while CUDA is untouched in this process (fast), spawn once it is initialised."""
    import torch

    return mp.get_context("spawn" if torch.cuda.is_initialized() else "fork")


def _worker(
    fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple, queue: Any
) -> None:
    os.environ.update(
        TORCHTITAN_DEVICE="cpu",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    import warnings

    import torch

    # pyproject's "error" warning filters are for the test process (a warning there fails the
    # test); a forked rank inherits them, and prints its warnings instead, as a launched rank does.
    warnings.filters[:] = [f for f in warnings.filters if f[0] != "error"]
    torch.set_num_threads(1)
    try:
        result = fn(*args)
        queue.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def start_ranks(
    fn: Callable[..., Any], world_size: int, args: tuple
) -> tuple[list[mp.process.BaseProcess], Any]:
    """Start ``world_size`` forked CPU ranks running ``fn(*args)``; their results arrive on the
    returned queue as ``(rank, ok, value)``."""
    ctx = mp_context()
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, port, args, queue))
        for r in range(world_size)
    ]
    # A forked rank must never free an object it inherited: one holding a gloo process group
    # would join the parent's threads, whose stacks the rank's own new threads may reuse (a
    # hang seen once in the slow tier). Collect here, and freeze what is left for the children.
    gc.collect()
    gc.freeze()
    try:
        for p in procs:
            p.start()
    finally:
        gc.unfreeze()
    return procs, queue


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300.0
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` CPU ranks; returns results ordered by rank."""
    procs, queue = start_ranks(fn, world_size, args)
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in procs:
            try:
                rank, ok, payload = queue.get(timeout=timeout)
            except queue_module.Empty:
                errors.append(
                    f"no result from {world_size - len(results)} rank(s) within {timeout:.0f} s"
                )
                break
            if ok:
                results[rank] = payload
            else:
                errors.append(f"--- rank {rank} ---\n{payload}")
                break  # other ranks may hang waiting for the failed one
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 30)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RuntimeError("distributed worker failed:\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]
