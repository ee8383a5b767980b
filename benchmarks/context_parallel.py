"""Context parallel: activation memory per rank and tokens/s against sequence length.

    python benchmarks/context_parallel.py                       # seq 2k/4k/8k x CP 1/2/4
    python benchmarks/context_parallel.py --seq_lens 8192 --cps 1,2 -- --model.flavor debugmodel

For each (seq_len, cp) it launches ``torchrun --nproc_per_node cp`` on this file, which builds the
real ``Trainer`` (one sequence per step, fp32, ``context_parallel_degree = cp``, nothing else
parallel), runs ``--warmup`` steps, then ``--steps`` timed steps, and prints one JSON line:

* ``activation_mib_max_rank``: bytes autograd saves for backward during one training step
  (``torch.autograd.graph.saved_tensors_hooks``; distinct storages; parameters and views of
  them excluded), the largest over the cp ranks. That is the activation memory alive at the end
  of the forward pass, exactly, on any device; it falls ~1/cp, plus the K/V that each attention
  layer gathers (GQA: the distinct kv heads) and keeps for its backward.
* ``peak_rss_gib_max_rank``: the process's peak resident memory (what the machine saw).
* ``tokens_per_s_per_device``: ``seq_len / cp`` tokens per rank per step over the median step;
  ``step_s_per_rank``: each rank's median step; ``attention_fwd_s_per_rank``: each rank's
  seconds per step in the forward of its CP attention cores (K/V gather included; forward
  hooks, so the backward is not in it).
  On a machine with fewer cores than ranks the ranks share cores, so this column shows the
  per-rank work, not the speed-up a real cluster gets.

Extra arguments after ``--`` are config overrides for every run; ``-- --model.flavor
cp_bench_tiny`` runs a scaled-down Llama 3 shape (dim 64, 2 layers, 4 heads) that this
benchmark registers, for sequences of 32k-128k on a CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from torchtitan.config.manager import split_overrides

ROOT = Path(__file__).resolve().parents[1]


def _saved_bytes_meter():  # type: ignore[no-untyped-def]
    """(hooks context, counter dict): sums distinct non-parameter storages saved for backward."""
    import torch
    from torch import nn

    seen: set[int] = set()
    counter = {"bytes": 0}

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if not isinstance(base, nn.Parameter) and t.device.type != "meta":
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                counter["bytes"] += storage.nbytes()
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), counter, seen


TINY = "cp_bench_tiny"
"""``-- --model.flavor cp_bench_tiny``: the scaled-down Llama 3 shape this benchmark registers."""


def _time_attention(model_parts: list) -> dict[str, float]:  # type: ignore[type-arg]
    """Seconds this rank spends in the forward of its CP attention cores (the K/V gather
    included), summed: forward hooks on every ``AllGatherKVAttention`` / ring core."""
    from torchtitan.distributed.context_parallel.core import AllGatherKVAttention
    from torchtitan.distributed.context_parallel.ring import RingDocumentAttention

    acc = {"s": 0.0, "t0": 0.0}

    def pre(module: object, args: object) -> None:
        acc["t0"] = time.perf_counter()

    def post(module: object, args: object, out: object) -> None:
        acc["s"] += time.perf_counter() - acc["t0"]

    for part in model_parts:
        for m in part.modules():
            if isinstance(m, (AllGatherKVAttention, RingDocumentAttention)):
                m.register_forward_pre_hook(pre)
                m.register_forward_hook(post)
    return acc


def worker(seq_len: int, warmup: int, steps: int, overrides: list[str]) -> None:
    import torch
    import torch.distributed as dist

    from torchtitan.distributed.utils import destroy_distributed
    from torchtitan.preflight.validate import load_config
    from torchtitan.tools.device_memory import DeviceMemoryMonitor
    from torchtitan.training.trainer import Trainer

    cp = int(os.environ["WORLD_SIZE"])
    dump = tempfile.mkdtemp(prefix="cp_bench_")
    if "--model.flavor" in overrides and TINY in overrides:
        from torchtitan.models.llama3.args import LLAMA3_FLAVORS, ModelArgs

        # The benchmark's own scaled-down shape (seq 32k-128k on a CPU): 1/4 of the debug
        # model's width, 2 layers, 4 heads of 16.
        LLAMA3_FLAVORS[TINY] = ModelArgs(
            dim=64, n_layers=2, n_heads=4, vocab_size=2048, max_seq_len=2048
        )
    cfg = load_config(
        [
            "--job.config_file",
            str(ROOT / "train_configs" / "debug_model.toml"),
            "--job.dump_folder",
            dump,
            "--training.seq_len",
            str(seq_len),
            "--training.local_batch_size",
            "1",
            "--training.global_batch_size",
            "-1",
            "--training.mixed_precision_param",
            "float32",
            "--training.steps",
            str(warmup + steps),
            "--parallelism.context_parallel_degree",
            str(cp),
            "--metrics.log_freq",
            "1000000",
            "--metrics.no-enable_tensorboard",
            *overrides,
        ]
    )
    trainer = Trainer(cfg)
    attention_s = _time_attention(trainer.model_parts)
    try:
        for _ in range(warmup):
            trainer.step += 1
            trainer.train_step()
        hooks, counter, seen = _saved_bytes_meter()
        with hooks:
            trainer.step += 1
            trainer.train_step()
        seen.clear()
        times = []
        attention_s["s"] = 0.0
        for _ in range(steps - 1):
            start = time.perf_counter()
            trainer.step += 1
            trainer.train_step()
            times.append(time.perf_counter() - start)
        per_rank = torch.zeros(cp, dtype=torch.float64)
        per_rank[trainer.rank] = attention_s["s"] / max(1, steps - 1)
        dist.all_reduce(per_rank)
        step_per_rank = torch.zeros(cp, dtype=torch.float64)
        step_per_rank[trainer.rank] = statistics.median(times) if times else float("nan")
        dist.all_reduce(step_per_rank)
        rss = DeviceMemoryMonitor(torch.device("cpu")).stats().peak_rss_gib
        stats = torch.tensor([counter["bytes"] / 2**20, rss], dtype=torch.float64)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        if trainer.rank == 0:
            step_s = statistics.median(times) if times else float("nan")
            print(
                "RESULT "
                + json.dumps(
                    {
                        "seq_len": seq_len,
                        "cp": cp,
                        "activation_mib_max_rank": round(float(stats[0]), 1),
                        "peak_rss_gib_max_rank": round(float(stats[1]), 3),
                        "step_time_s": round(step_s, 3),
                        "tokens_per_s_per_device": round(seq_len / cp / step_s, 1),
                        "step_s_per_rank": [round(float(t), 3) for t in step_per_rank],
                        "attention_fwd_s_per_rank": [round(float(t), 3) for t in per_rank],
                        "model": f"{cfg.model.name} {cfg.model.flavor}",
                        "threads_per_rank": torch.get_num_threads(),
                        "load_avg": list(os.getloadavg()),
                        "torch": torch.__version__,
                    }
                ),
                flush=True,
            )
    finally:
        trainer.close()
        destroy_distributed()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, overrides = split_overrides(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq_lens", default="2048,4096,8192")
    ap.add_argument("--cps", default="1,2,4")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3, help="measured steps (the first counts memory)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--seq_len", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(own)
    if args.worker:
        worker(args.seq_len, args.warmup, args.steps, overrides)
        return 0
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    failed = 0
    for seq_len in map(int, args.seq_lens.split(",")):
        for cp in map(int, args.cps.split(",")):
            cmd = [torchrun, "--standalone", "--nproc_per_node", str(cp), __file__, "--worker"]
            cmd += ["--seq_len", str(seq_len), "--warmup", str(args.warmup)]
            cmd += ["--steps", str(args.steps), "--", *overrides]
            run = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
            lines = [x for x in run.stdout.splitlines() if x.startswith("RESULT ")]
            if run.returncode != 0 or not lines:
                failed += 1
                errors = [x for x in run.stderr.splitlines() if "Error" in x or "error:" in x]
                tail = "\n".join([*errors[:5], *run.stderr.splitlines()[-5:]])
                print(json.dumps({"seq_len": seq_len, "cp": cp, "error": tail}), flush=True)
                continue
            print(lines[-1].removeprefix("RESULT "), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
