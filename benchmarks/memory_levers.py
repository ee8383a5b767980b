"""Each memory lever's saving, measured against the estimator's prediction (docs/planning.md).

::

    python benchmarks/memory_levers.py [--models debugmodel,cpu_large] [--levers ...]

For each model (the debug model; ``cpu_large``: dim 512, 8 layers, GQA, the flavor the
estimator's calibration test uses; ``cpu_vocab_heavy``: dim 64, 2 layers, where the loss over the
2048-token vocabulary is the peak) and each lever, the ranks train a few fp32 steps (seq 64,
8 sequences per rank) under ``LiveTensorTracker`` and report the steady-state peak of live tensor
memory (the largest over the ranks); the estimator (``device_type="cpu"``) predicts the same
peak. The lever's saving is ``base - lever`` on the same number of ranks, measured and
estimated, and each JSON row gives their relative difference (goal <= 10%). Every case runs in
processes of its own (a fresh process group; ranks are subprocesses on gloo).

CPU offload (``offload_fsdp2``: 2 FSDP ranks against 2 FSDP ranks without it; ``offload_1dev``:
one rank, FSDP on a 1-rank mesh): on a CPU-only machine the offloaded shards stay in the memory
the tracker follows, so the device peak is computed from the tracker's log as the peak of
everything but the storages FSDP2's ``CPUOffloadPolicy`` keeps on the host, named by storage at
the end of each step: the sharded parameters' local tensors, their gradients, the optimizer
states, and whatever the optimizer step (which runs on the host tensors) creates. The all-gather
and reduce-scatter buffers FSDP makes stay counted as device. What this cannot see: on an
accelerator FSDP also copies each unit's shards to the device before the all-gather and the
reduce-scatter output back to the host; on the CPU those copies are no-ops.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from torchtitan.models.llama3.args import LLAMA3_FLAVORS, ModelArgs

ROOT = Path(__file__).resolve().parents[1]
BASE = [
    "--job.config_file",
    str(ROOT / "train_configs" / "debug_model.toml"),
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "8",
    "--training.mixed_precision_param",
    "float32",
    "--metrics.no-enable_tensorboard",
    "--metrics.no-enable_jsonl",
    "--metrics.no-enable_memory_trace",
]
OFFLOAD = ["--parallelism.fsdp_cpu_offload"]
# lever -> (ranks, overrides); each lever is compared with "base" on the same number of ranks.
LEVERS = {
    "chunked_loss_128": (1, ["--training.loss_chunk_size", "128"]),
    "bf16_moments": (1, ["--optimizer.moments_dtype", "bfloat16"]),
    "bf16_master_weights": (
        1,
        [
            "--optimizer.master_weights_dtype",
            "bfloat16",
            "--training.mixed_precision_param",
            "bfloat16",
        ],
    ),
    "offload_1dev": (1, OFFLOAD),
    "offload_fsdp2": (2, OFFLOAD),
}


# The CPU-sized flavors (also the estimator calibration test's ``cpu_large``).
CPU_LARGE = ModelArgs(
    dim=512,
    n_layers=8,
    n_heads=8,
    n_kv_heads=2,
    vocab_size=2048,
    ffn_dim_multiplier=1.3,
    multiple_of=256,
    max_seq_len=2048,
)
# Narrow and shallow: the loss (vocabulary 2048 x 512 tokens) is the peak.
CPU_VOCAB_HEAVY = ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=2048, max_seq_len=2048)


def register_flavors() -> None:
    LLAMA3_FLAVORS["cpu_large"] = CPU_LARGE
    LLAMA3_FLAVORS["cpu_vocab_heavy"] = CPU_VOCAB_HEAVY


def measure(argv: list[str], steps: int) -> dict:
    """This rank's steady-state peaks (all tensors, and device-resident ones under offload)."""
    register_flavors()
    import torch

    from torchtitan.planner.tracker import LiveTensorTracker
    from torchtitan.preflight.validate import load_config
    from torchtitan.training.trainer import Trainer

    trainer = Trainer(load_config(argv))
    params = [p for part in trainer.model_parts for p in part.parameters()]
    held = [*params, *(b for part in trainer.model_parts for b in part.buffers())]
    offload = trainer.cfg.parallelism.fsdp_cpu_offload
    optimizer = trainer.optimizer
    peaks, device = [], []
    with LiveTensorTracker(record=True) as tracker:
        tracker.add(held)
        on_host: set[int] = set()  # storages the optimizer step makes (it runs on host tensors)
        plain_step = optimizer.step

        def step(*args: object, **kwargs: object) -> object:
            with tracker.collecting() as made:
                out = plain_step(*args, **kwargs)
            on_host.update(made)
            return out

        optimizer.step = step  # type: ignore[method-assign]
        for _ in range(steps):
            tracker.reset_peak()
            on_host.clear()
            trainer.step += 1
            trainer.train_step()
            peaks.append(tracker.peak)
            if offload:
                # What CPUOffloadPolicy keeps on the host, named by storage (module doc).
                states = [t for s in optimizer.state.values() for t in s.values()]
                grads = [p.grad for p in params if p.grad is not None]
                tensors = [t for t in [*params, *grads, *states] if isinstance(t, torch.Tensor)]
                host = tracker.serials(tensors)
                device.append(tracker.peak_excluding(host | on_host))
                del (
                    states,
                    grads,
                    tensors,
                )  # holding last step's gradients would change the next peak
            else:
                device.append(tracker.peak)
    trainer.close()
    return {"measured": max(peaks[1:]), "device": max(device[1:])}


def _estimate(argv: list[str], ranks: int) -> dict:
    from torchtitan.config.manager import parse_args
    from torchtitan.planner.estimator import estimate_memory

    est = estimate_memory(parse_args(argv), ranks, device_type="cpu")
    return {"estimated": est.tensor_peak, "phase": est.phase, "host": est.host}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_case(argv: list[str], ranks: int, steps: int) -> dict:
    """Measure ``argv`` on ``ranks`` gloo ranks (subprocesses) and estimate it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCHTITAN_DEVICE": "cpu"}
    if ranks > 1:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(ranks))
        env.update(LOCAL_WORLD_SIZE=str(ranks), OMP_NUM_THREADS="1")
    cmd = [sys.executable, __file__, "--steps", str(steps), "--case", json.dumps(argv)]
    procs = [
        subprocess.Popen(
            cmd,
            cwd=ROOT,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)} if ranks > 1 else env,
        )
        for r in range(ranks)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate()
        line = [x for x in out.splitlines() if x.startswith("RESULT ")]
        if proc.returncode != 0 or not line:
            raise RuntimeError(f"case failed: {argv}\n{err[-3000:]}")
        results.append(json.loads(line[-1][len("RESULT ") :]))
    register_flavors()
    return {
        "measured": max(r["measured"] for r in results),
        "device": max(r["device"] for r in results),
        **_estimate(argv, ranks),
    }


def lever_row(model: str, lever: str, base: dict, got: dict) -> dict:
    saved_m = base["device"] - got["device"]
    saved_e = base["estimated"] - got["estimated"]
    return {
        "model": model,
        "lever": lever,
        "ranks": LEVERS[lever][0],
        "base_measured_mib": base["device"] / 2**20,
        "base_estimated_mib": base["estimated"] / 2**20,
        "measured_mib": got["device"] / 2**20,
        "estimated_mib": got["estimated"] / 2**20,
        "saving_measured_mib": saved_m / 2**20,
        "saving_estimated_mib": saved_e / 2**20,
        "saving_rel_diff": (saved_e - saved_m) / saved_m if saved_m else None,
        "phase": got["phase"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", default="debugmodel,cpu_large,cpu_vocab_heavy")
    p.add_argument("--levers", default=",".join(LEVERS))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one rank, print its JSON
    args = p.parse_args(argv)
    if args.case:
        print("RESULT " + json.dumps(measure(json.loads(args.case), args.steps)))
        return 0
    rows = []
    for model in args.models.split(","):
        bases: dict[int, dict] = {}
        for lever in args.levers.split(","):
            ranks, overrides = LEVERS[lever]
            with tempfile.TemporaryDirectory() as tmp:
                case = [*BASE, "--model.flavor", model, "--job.dump_folder", tmp]
                if ranks not in bases:
                    bases[ranks] = run_case(case, ranks, args.steps)
                got = run_case([*case, *overrides], ranks, args.steps)
            rows.append(lever_row(model, lever, bases[ranks], got))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
