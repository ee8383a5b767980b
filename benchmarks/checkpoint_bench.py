"""Checkpoint save/load times and async overlap, one process, CPU or GPU.

    python benchmarks/checkpoint_bench.py [--flavors debug,large] [--steps 6]

For each model (``debug``: the debug model; ``large``: the same with dim 1024 and 8 layers)
it builds the model and AdamW state, then measures with the real CheckpointManager:
a synchronous save, a load, an async save's blocking part (staging a CPU copy) and its
background write, and the training step time with and without a background write in flight
(the overlap). Prints one JSON line per model.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchtitan.components.checkpoint import CheckpointManager  # noqa: E402
from torchtitan.models.llama3.args import LLAMA3_FLAVORS  # noqa: E402
from torchtitan.models.llama3.model import Transformer  # noqa: E402

FLAVORS = {
    "debug": LLAMA3_FLAVORS["debugmodel"],
    "large": dataclasses.replace(LLAMA3_FLAVORS["debugmodel"], dim=1024, n_layers=8),
}


class _NoData:
    def state_dict(self) -> dict:
        return {"dp_rank_0": b"", "dp_world_size": 1}

    def load_state_dict(self, sd: dict) -> None:
        pass


def bench(name: str, steps: int, seq_len: int = 64, batch: int = 4) -> dict:
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
        t0 = time.perf_counter()
        sync.save(1, 0)
        save_s = time.perf_counter() - t0
        size = sum(f.stat().st_size for f in (Path(tmp) / "disabled" / "step-1").iterdir())
        t0 = time.perf_counter()
        sync.load()
        load_s = time.perf_counter() - t0
        sync.close()

        plain = [train_step() for _ in range(steps)]
        asy = manager("async")
        t0 = time.perf_counter()
        asy.save(2, 0)
        blocking_s = time.perf_counter() - t0
        assert asy._pending is not None
        overlapped = []
        while not asy._pending[1].done():
            overlapped.append(train_step())
        write_s = time.perf_counter() - t0 - blocking_s
        asy.close()
    return {
        "model": name,
        "params": sum(p.numel() for p in model.parameters()),
        "checkpoint_MB": round(size / 2**20, 1),
        "sync_save_s": round(save_s, 3),
        "load_s": round(load_s, 3),
        "async_blocking_s": round(blocking_s, 3),
        "async_background_write_s": round(write_s, 3),
        "steps_overlapped": len(overlapped),
        "step_s_plain": round(sum(plain) / len(plain), 4),
        "step_s_during_async_write": round(sum(overlapped) / max(len(overlapped), 1), 4),
        "threads": torch.get_num_threads(),
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--flavors", default="debug,large")
    p.add_argument("--steps", type=int, default=4)
    a = p.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    try:
        for name in a.flavors.split(","):
            print(json.dumps(bench(name, a.steps)), flush=True)
    finally:
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
