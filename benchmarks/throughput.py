"""Throughput of the real trainer: tokens/s per device, step time, MFU and peak memory as JSON.

One run::

    python benchmarks/throughput.py --warmup 3 --steps 10 -- \\
        --job.config_file train_configs/debug_model.toml --compile.enable

builds the ``Trainer`` for that config, runs ``--warmup`` steps of its real training loop
(compilation, allocator and optimizer-state warm-up), then times ``--steps`` more and prints one
JSON line (rank 0) with:

* ``tokens_per_s_per_device`` and ``step_time_s`` over the timed steps (wall clock, device
  synchronized at both ends);
* ``mfu_measured_pct``: model FLOP/s against the dense matmul peak measured in this run, by a
  large matmul in the run's parameter dtype, after the timed steps (so it does not disturb them);
* ``mfu_datasheet_pct``: against the vendor's dense peak for this device and dtype, ``null``
  where the device is not in ``torchtitan/tools/peak_flops.py`` (CPUs, unknown GPUs): never
  guessed;
* ``peak_memory_gib`` (CUDA: allocated peak; CPU: peak process RSS) and the config.

Model FLOPs per token are ``ModelArgs.flops_per_token`` (6 x non-embedding params + attention,
recompute not counted). With float8 the MFU is still against the parameter-dtype peak (bf16 on
a GPU), the usual convention, so float8 shows up as MFU above what the dtype could give.

Several configurations (each in a fresh process, one JSON line each)::

    python benchmarks/throughput.py --ladder -- --job.config_file train_configs/debug_model.toml

runs eager, +compile, AC full / selective op (eager and compiled), float8 tensorwise and
rowwise (eager and compiled). Under torchrun every rank runs and rank 0 prints.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LADDER: list[tuple[str, list[str]]] = [
    ("eager", []),
    ("compile", ["--compile.enable"]),
    ("ac_full", ["--activation_checkpoint.mode", "full"]),
    ("compile+ac_full", ["--compile.enable", "--activation_checkpoint.mode", "full"]),
    (
        "compile+ac_op",
        [
            "--compile.enable",
            "--activation_checkpoint.mode",
            "selective",
            "--activation_checkpoint.selective_ac_option",
            "op",
        ],
    ),
    ("float8_tensorwise", ["--quantize.dense.float8.enable"]),
    (
        "compile+float8_tensorwise",
        ["--compile.enable", "--quantize.dense.float8.enable"],
    ),
    (
        "compile+float8_rowwise",
        [
            "--compile.enable",
            "--quantize.dense.float8.enable",
            "--quantize.dense.float8.recipe_name",
            "rowwise",
        ],
    ),
]


def _sync(device) -> None:  # type: ignore[no-untyped-def]
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_name(device) -> str:  # type: ignore[no-untyped-def]
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run_one(overrides: list[str], warmup: int, steps: int, label: str) -> dict | None:
    """Train ``warmup + steps`` steps of the config; returns the result (rank 0) or None."""
    import torch

    from torchtitan.config.manager import parse_args
    from torchtitan.distributed.utils import destroy_distributed
    from torchtitan.tools.peak_flops import datasheet_peak_flops, measure_matmul_peak_flops
    from torchtitan.trainer import Trainer

    cfg = parse_args([*overrides, "--training.steps", str(warmup + steps)])
    trainer = Trainer(cfg)
    logged: list[dict] = []
    log = trainer.metrics.log

    def capture(step: int, lr: float) -> dict:
        out = log(step, lr)
        logged.append(dict(out))
        return out

    trainer.metrics.log = capture  # type: ignore[method-assign]
    try:
        # Warm-up through the real loop: compile, allocator, optimizer state.
        cfg.training.steps = warmup
        trainer.train()
        cfg.training.steps = warmup + steps
        device = trainer.device
        _sync(device)
        start = time.perf_counter()
        trainer.train()
        _sync(device)
        elapsed = time.perf_counter() - start
        dtype = trainer.param_dtype
        # A longer budget than the trainer's start-up measurement: the fastest of more matmuls
        # is a steadier estimate of the peak on a machine shared with other work.
        peak_measured = measure_matmul_peak_flops(device, dtype, budget_s=5.0)
        peak_datasheet = datasheet_peak_flops(device, dtype)
    finally:
        trainer.close()
        destroy_distributed()
    if trainer.rank != 0:
        return None

    t = cfg.training
    tps = trainer.device_tokens_per_step * steps / elapsed
    flops_per_token = trainer.model_args.flops_per_token(t.seq_len)
    achieved = flops_per_token * tps
    mem_key = "memory/peak_gib"
    peak_mem = max((m[mem_key] for m in logged if mem_key in m), default=None)
    dims = trainer.parallel_dims
    f8 = cfg.quantize.dense.float8
    n_float8 = sum(
        type(m).__name__ == "Float8Linear" for part in trainer.model_parts for m in part.modules()
    )
    return {
        "label": label,
        "tokens_per_s_per_device": round(tps, 1),
        "step_time_s": round(elapsed / steps, 4),
        "mfu_measured_pct": round(100 * achieved / peak_measured, 2),
        "peak_tflops_measured": round(peak_measured / 1e12, 4),
        "mfu_datasheet_pct": None
        if peak_datasheet is None
        else round(100 * achieved / peak_datasheet, 2),
        "peak_tflops_datasheet": None if peak_datasheet is None else peak_datasheet / 1e12,
        "peak_memory_gib": None if peak_mem is None else round(peak_mem, 3),
        "memory_kind": "cuda allocated" if device.type == "cuda" else "process RSS",
        "loss_last": logged[-1]["loss"] if logged else None,
        "steps": steps,
        "warmup": warmup,
        "device": device.type,
        "device_name": _device_name(device),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "world_size": dims.world_size,
        "config": {
            "overrides": overrides,
            "model": f"{cfg.model.name} {cfg.model.flavor}",
            "seq_len": t.seq_len,
            "local_batch_size": t.local_batch_size,
            "param_dtype": str(dtype).removeprefix("torch."),
            "compile": cfg.compile.enable,
            "activation_checkpoint": cfg.activation_checkpoint.mode
            + (
                f"/{cfg.activation_checkpoint.selective_ac_option}"
                if cfg.activation_checkpoint.mode == "selective"
                else ""
            ),
            "float8": f"{f8.recipe_name} ({n_float8} linears)" if f8.enable else None,
            "degrees": {
                "dp_replicate": dims.dp_replicate,
                "dp_shard": dims.dp_shard,
                "tp": dims.tp,
                "pp": dims.pp,
                "cp": dims.cp,
            },
        },
    }


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, overrides = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    )
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    p.add_argument("--label", default="run", help="name in the JSON line")
    p.add_argument(
        "--ladder", action="store_true", help="run the LADDER variants, one process each"
    )
    p.add_argument("--only", default="", help="with --ladder: comma-separated labels to run")
    args = p.parse_args(own)
    if args.ladder:
        wanted = set(filter(None, args.only.split(",")))
        rc = 0
        for label, extra in LADDER:
            if wanted and label not in wanted:
                continue
            cmd = [sys.executable, __file__, "--warmup", str(args.warmup), "--steps", str(args.steps),
                   "--label", label, "--", *overrides, *extra]  # fmt: skip
            res = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
            lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
            if res.returncode != 0 or not lines:
                print(
                    json.dumps({"label": label, "error": f"exit code {res.returncode}"}), flush=True
                )
                rc = 1
            else:
                print(lines[-1], flush=True)
        return rc
    os.environ.setdefault("WANDB_MODE", "offline")
    result = run_one(overrides, args.warmup, args.steps, args.label)
    if result is not None:
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
