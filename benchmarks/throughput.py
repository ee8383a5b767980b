"""Throughput of the real trainer: tokens/s per device, step time, MFU and peak memory as JSON.

One run::

    python benchmarks/throughput.py --warmup 3 --steps 10 -- \\
        --job.config_file train_configs/debug_model.toml --compile.enable

builds the ``Trainer`` for that config, runs ``--warmup`` steps of its real training loop
(compilation, allocator and optimizer-state warm-up), then times ``--steps`` more and prints one
JSON line (rank 0) with:

* ``tokens_per_s_per_device`` and ``step_time_s`` over the timed steps (wall clock, device
  synchronized at both ends); ``step_time_median_s`` and ``step_time_min_s`` from per-step
  stamps (on a GPU these are host-side stamps: the trainer's one sync per step keeps them close);
* ``mfu_measured_pct``: model FLOP/s against the dense matmul peak measured in this run, by a
  large matmul in the run's parameter dtype, after the timed steps (so it does not disturb them);
* ``mfu_datasheet_pct``: against the vendor's dense peak for this device and dtype, ``null``
  where the device is not in ``torchtitan/tools/peak_flops.py`` (CPUs, unknown GPUs): never
  guessed;
* on CPU also ``cpu_time_step_s`` (median process CPU time per step), ``tokens_per_cpu_s`` and
  ``mfu_cpu_time_pct`` (against a matmul peak also timed in CPU time): what the process did with
  the CPU time it got. Other work on the machine stretches wall-clock time but barely CPU time,
  so on a busy machine run ``--threads 1`` (no OpenMP threads spinning while a sibling waits
  for a core) and read these; on a quiet one they match the wall-clock figures;
* with image-text data (``--model.name qwen3_5_vl``, docs/vlm.md) also
  ``images_per_s_per_device`` and the images and tower patches per timed step
  (``benchmarks/vlm_throughput.py`` makes the data and runs this);
* ``peak_memory_gib`` (CUDA: allocated peak; CPU: peak process RSS), the config, the device,
  torch version and the machine's load averages before and after the timed steps
  (``load_avg``/``load_avg_end``, 1/5/15 min), so a figure taken on a busy machine says so.

Model FLOPs per token are ``ModelArgs.flops_per_token`` (6 x non-embedding params + attention,
recompute not counted). With float8 the MFU is still against the parameter-dtype peak (bf16 on
a GPU), the usual convention, so float8 shows up as MFU above what the dtype could give.

Several configurations (each in a fresh process, one JSON line each)::

    python benchmarks/throughput.py --ladder -- --job.config_file train_configs/debug_model.toml

runs the ``LADDER`` below (``--only a,b`` picks labels). Under torchrun every rank runs and
rank 0 prints.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from torchtitan.config.manager import split_overrides

ROOT = Path(__file__).resolve().parents[1]

_COMPILE = ["--compile.enable"]
_AC_FULL = ["--activation_checkpoint.mode", "full"]
_AC_OP = ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"]  # fmt: skip
_F8_TW = ["--quantize.dense.float8.enable", "--quantize.dense.float8.recipe_name", "tensorwise"]
_F8_RW = ["--quantize.dense.float8.enable", "--quantize.dense.float8.recipe_name", "rowwise"]
_BLOCK = ["--model.attn_mask_type", "block_causal"]
_MOE = ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe"]
_DSV3 = ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel"]
_GPT_OSS = ["--model.name", "gpt_oss", "--model.flavor", "debugmodel"]
_QWEN35 = ["--model.name", "qwen3_5", "--model.flavor", "debugmodel"]
_QWEN35_MOE = ["--model.name", "qwen3_5", "--model.flavor", "debugmodel_moe"]
_F8_EXPERTS = ["--quantize.moe.float8.enable"]


def _shape_rows(name: str, shape: list[str]) -> list[tuple[str, list[str]]]:
    """bf16 eager, compiled, and compiled with float8 experts, of a published shape at 4 blocks
    (a row may set its own ``--model.n_layers`` after, which wins)."""
    shape = ["--model.n_layers", "4", *shape]
    return [
        (name, shape),
        (f"compile+{name}", _COMPILE + shape),
        (f"compile+float8_experts+{name}", _COMPILE + _F8_EXPERTS + shape),
    ]


LADDER: list[tuple[str, list[str]]] = [
    ("eager", []),
    ("compile", _COMPILE),
    ("ac_full", _AC_FULL),
    ("ac_op", _AC_OP),
    ("compile+ac_full", _COMPILE + _AC_FULL),
    ("compile+ac_op", _COMPILE + _AC_OP),
    ("float8_tensorwise", _F8_TW),
    ("float8_rowwise", _F8_RW),
    ("compile+float8_tensorwise", _COMPILE + _F8_TW),
    ("compile+float8_rowwise", _COMPILE + _F8_RW),
    ("compile+ac_op+float8_tensorwise", _COMPILE + _AC_OP + _F8_TW),
    ("compile+ac_op+float8_rowwise", _COMPILE + _AC_OP + _F8_RW),
    # Document masking (docs/attention.md): FlexAttention on CUDA, the exact dense-mask SDPA
    # path elsewhere; compare with eager / compile above.
    ("block_causal", _BLOCK),
    ("compile+block_causal", _COMPILE + _BLOCK),
    # Qwen3 dense and MoE (docs/moe.md): 8 experts top-2 + one shared, grouped GEMM where the
    # device supports it; MFU counts the active parameters only.
    ("qwen3", ["--model.name", "qwen3", "--model.flavor", "debugmodel"]),
    ("qwen3_moe", _MOE),
    ("qwen3_moe+ac_full", _MOE + _AC_FULL),
    ("compile+qwen3_moe", _COMPILE + _MOE),
    # The other families' debug flavors (DeepSeek-V3: MLA, sigmoid routing, one MTP depth;
    # GPT-OSS: sinks, sliding windows, biased experts): scripts/gpu_check.sh runs them.
    ("deepseek_v3", _DSV3),
    ("compile+deepseek_v3", _COMPILE + _DSV3),
    ("gpt_oss", _GPT_OSS),
    ("compile+gpt_oss", _COMPILE + _GPT_OSS),
    # Qwen3.5 (docs/qwen3_5.md): Gated DeltaNet + gated attention, dense and MoE; the delta
    # rule runs flash-linear-attention's kernel on CUDA when installed.
    ("qwen3_5", _QWEN35),
    ("compile+qwen3_5", _COMPILE + _QWEN35),
    ("qwen3_5_moe", _QWEN35_MOE),
    *[
        row
        for name, shape in (
            ("qwen3_30b_a3b", ["--model.name", "qwen3", "--model.flavor", "30B-A3B"]),
            (
                "qwen3_235b_a22b",
                [
                    "--model.name",
                    "qwen3",
                    "--model.flavor",
                    "235B-A22B",
                    "--model.moe_num_experts",
                    "32",
                ],
            ),  # fmt: skip
            ("dsv2_lite_16b", ["--model.name", "deepseek_v3", "--model.flavor", "16B"]),
            (
                "dsv3_671b_width",
                [
                    "--model.name",
                    "deepseek_v3",
                    "--model.flavor",
                    "671B",
                    "--model.moe_num_experts",
                    "16",
                    "--model.mtp_depth",
                    "0",
                ],
            ),  # fmt: skip
            (
                "gpt_oss_20b",
                [
                    "--model.name",
                    "gpt_oss",
                    "--model.flavor",
                    "20b",
                    "--model.moe_num_experts",
                    "16",
                ],
            ),  # fmt: skip
            (
                "gpt_oss_120b",
                [
                    "--model.name",
                    "gpt_oss",
                    "--model.flavor",
                    "120b",
                    "--model.n_layers",
                    "2",
                    "--model.moe_num_experts",
                    "64",
                ],
            ),  # fmt: skip
        )
        for row in _shape_rows(name, shape)
    ],
]
"""The published MoE shapes (docs/performance.md, "MoE at published shapes"): each at 4 blocks
(``--model.n_layers``, every other dimension kept), bf16 eager and compiled, and compiled with
float8 experts. Where the whole model would not train on one 80 GB GPU (parameters, gradients
and AdamW in fp32: 16 bytes per parameter), fewer routed experts of the published width and
top-k (``--model.moe_num_experts``): an expert GEMM keeps its shape, each expert sees more rows,
as under expert parallel. GPT-OSS 120b differs from 20b only in depth and expert count, so its
row keeps more experts at 2 blocks."""


def _sync(device) -> None:  # type: ignore[no-untyped-def]
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _load_avg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


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


def run_one(
    overrides: list[str], warmup: int, steps: int, label: str, peak_budget_s: float = 5.0
) -> dict | None:
    """Train ``warmup + steps`` steps of the config; returns the result (rank 0) or None."""
    import torch

    from torchtitan.distributed.utils import destroy_distributed
    from torchtitan.preflight.validate import load_config
    from torchtitan.tools.peak_flops import datasheet_peak_flops, measure_matmul_peak_flops
    from torchtitan.training.trainer import Trainer

    cfg = load_config([*overrides, "--training.steps", str(warmup + steps)])
    trainer = Trainer(cfg)
    logged: list[dict] = []
    stamps: list[float] = []
    cpu_stamps: list[float] = []
    log, end_step = trainer.metrics.log, trainer.metrics.end_step

    def capture(step: int, lr: float) -> dict:
        out = log(step, lr)
        logged.append(dict(out))
        return out

    def stamp(*args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        end_step(*args, **kwargs)
        stamps.append(time.perf_counter())
        cpu_stamps.append(time.process_time())

    trainer.metrics.log = capture  # type: ignore[method-assign]
    trainer.metrics.end_step = stamp  # type: ignore[method-assign]
    images = _count_images(trainer)
    try:
        # Warm-up through the real loop: compile, allocator, optimizer state.
        cfg.training.steps = warmup
        trainer.train()
        cfg.training.steps = warmup + steps
        device = trainer.device
        _sync(device)
        load_start = _load_avg()
        start, cpu_start = time.perf_counter(), time.process_time()
        stamps.clear()
        cpu_stamps.clear()
        images.clear()
        trainer.train()
        _sync(device)
        elapsed = time.perf_counter() - start
        load_end = _load_avg()
        per_step = [b - a for a, b in zip([start, *stamps], stamps)]
        cpu_step = statistics.median(b - a for a, b in zip([cpu_start, *cpu_stamps], cpu_stamps))
        dtype = trainer.param_dtype
        # A longer budget than the trainer's start-up measurement: the fastest of more matmuls
        # is a steadier estimate of the peak on a machine shared with other work.
        peak_measured = measure_matmul_peak_flops(device, dtype, budget_s=peak_budget_s)
        peak_datasheet = datasheet_peak_flops(device, dtype)
        peak_cpu_time = (
            measure_matmul_peak_flops(device, dtype, budget_s=peak_budget_s, cpu_time=True)
            if device.type == "cpu"
            else None
        )
    finally:
        trainer.close()
        destroy_distributed()
    if trainer.rank != 0:
        return None

    t = cfg.training
    tps = trainer.device_tokens_per_step * steps / elapsed
    flops_per_token = (
        trainer.metrics.flops_per_token
    )  # what the log's MFU counts (planner/lora_memory.py)
    achieved = flops_per_token * tps
    mem_key = "memory/peak_gib"
    peak_mem = max((m[mem_key] for m in logged if m.get(mem_key) is not None), default=None)
    dims = trainer.parallel_dims
    f8 = cfg.quantize.dense.float8
    n_float8 = sum(
        type(m).__name__ == "Float8Linear" for part in trainer.model_parts for m in part.modules()
    )
    ac = cfg.activation_checkpoint
    return {
        "label": label,
        "tokens_per_s_per_device": round(tps, 1),
        "step_time_s": round(elapsed / steps, 4),
        "step_time_median_s": round(statistics.median(per_step), 4),
        "step_time_min_s": round(min(per_step), 4),
        "mfu_measured_pct": round(100 * achieved / peak_measured, 2),
        "peak_tflops_measured": round(peak_measured / 1e12, 4),
        "mfu_datasheet_pct": None
        if peak_datasheet is None
        else round(100 * achieved / peak_datasheet, 2),
        "peak_tflops_datasheet": None if peak_datasheet is None else peak_datasheet / 1e12,
        "flops_per_token": flops_per_token,
        **_image_rates(images, elapsed, steps, cpu_step if peak_cpu_time else None),
        "cpu_time_step_s": round(cpu_step, 4) if peak_cpu_time else None,
        "tokens_per_cpu_s": round(trainer.device_tokens_per_step / cpu_step, 1)
        if peak_cpu_time
        else None,
        "mfu_cpu_time_pct": round(
            100 * flops_per_token * trainer.device_tokens_per_step / cpu_step / peak_cpu_time, 2
        )
        if peak_cpu_time
        else None,
        "peak_tflops_cpu_time": round(peak_cpu_time / 1e12, 4) if peak_cpu_time else None,
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
        "load_avg": load_start,
        "load_avg_end": load_end,
        "config": {
            "overrides": overrides,
            "model": f"{cfg.model.name} {cfg.model.flavor}",
            "seq_len": t.seq_len,
            "local_batch_size": t.local_batch_size,
            "param_dtype": str(dtype).removeprefix("torch."),
            "compile": cfg.compile.enable,
            "activation_checkpoint": ac.mode
            + (f"/{ac.selective_ac_option}" if ac.mode == "selective" else ""),
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


def _count_images(trainer) -> dict[str, int]:  # type: ignore[no-untyped-def]
    """Counts of the images and patches the rank's microbatches carry (image-text data:
    ``pixel_values`` / ``grid_thw`` model inputs; docs/vlm.md), cleared before the timed steps."""
    counts: dict[str, int] = {}
    draw = trainer.stepper.next_batch

    def counted():  # type: ignore[no-untyped-def]
        batch = draw()
        grid = batch[2].get("grid_thw")
        if grid is not None:
            counts["images"] = counts.get("images", 0) + len(grid)
            counts["patches"] = counts.get("patches", 0) + int(grid.prod(-1).sum())
        return batch

    trainer.stepper.next_batch = counted
    return counts


def _image_rates(
    counts: dict[str, int], elapsed: float, steps: int, cpu_step: float | None
) -> dict:
    """``images_per_s_per_device`` (and on CPU ``images_per_cpu_s``, per median process CPU
    time of a step) and the images and patches per timed step; nothing for text data."""
    if not counts:
        return {}
    per_step = counts["images"] / steps
    return {
        "images_per_s_per_device": round(counts["images"] / elapsed, 2),
        "images_per_cpu_s": round(per_step / cpu_step, 2) if cpu_step else None,
        "images_per_step": per_step,
        "patches_per_step": counts["patches"] / steps,
    }


def _preflight(label: str, overrides: list[str]) -> int:
    """One JSON line: whether the row's config passes the preflight (one rank; no memory fit
    check: that needs the GPU) and the model it builds."""
    from torchtitan.config import parse_args
    from torchtitan.config.errors import ConfigError
    from torchtitan.models import MODELS, run_args
    from torchtitan.preflight.validate import validate_config

    try:
        cfg = parse_args(overrides)
        validate_config(cfg, world_size=1)
    except ConfigError as e:
        print(json.dumps({"label": label, "error": str(e)}), flush=True)
        return 1
    args = run_args(cfg, vocab_size=2048)
    row = {
        "label": label,
        "model": f"{cfg.model.name} {cfg.model.flavor}",
        "n_layers": args.n_layers,
    }
    moe = args.moe
    row["experts"] = f"{moe.num_experts} x top-{moe.top_k}, {args.dim} x {moe.expert_dim}"
    row["params_b"] = round(MODELS[cfg.model.name].num_params(args) / 1e9, 2)
    print(json.dumps(row), flush=True)
    return 0


def run_ladder(args: argparse.Namespace, overrides: list[str]) -> int:
    """Each LADDER entry in a fresh process (compile and float8 state do not leak between them)."""
    wanted = set(filter(None, args.only.split(",")))
    unknown = wanted - {label for label, _ in LADDER}
    if unknown:
        raise SystemExit(
            f"--only: unknown labels {sorted(unknown)}; known: {[x for x, _ in LADDER]}"
        )
    rc = 0
    for label, extra in LADDER:
        if wanted and label not in wanted:
            continue
        if args.preflight:
            rc |= _preflight(label, [*overrides, *extra])
            continue
        print(f"throughput ladder: {label} ...", file=sys.stderr, flush=True)
        cmd = [sys.executable, __file__, "--warmup", str(args.warmup), "--steps", str(args.steps),
               "--peak-budget", str(args.peak_budget), "--threads", str(args.threads),
               "--label", label, "--",
               *overrides, *extra]  # fmt: skip
        res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
        if res.returncode != 0 or not lines:
            err = {"label": label, "error": f"exit code {res.returncode}", "stderr_tail": res.stderr[-2000:]}  # fmt: skip
            print(json.dumps(err), flush=True)
            rc = 1
        else:
            print(lines[-1], flush=True)
    return rc


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, overrides = split_overrides(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    p.add_argument("--label", default="run", help="name in the JSON line")
    p.add_argument(
        "--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)"
    )
    p.add_argument(
        "--peak-budget", type=float, default=5.0, help="seconds for the CPU matmul peak (default 5)"
    )
    p.add_argument(
        "--ladder", action="store_true", help="run the LADDER variants, one process each"
    )
    p.add_argument("--only", default="", help="with --ladder: comma-separated labels to run")
    p.add_argument(
        "--preflight",
        action="store_true",
        help="with --ladder: only check each row's config (one JSON line each), train nothing",
    )
    args = p.parse_args(own)
    if args.warmup < 1 or args.steps < 1:
        p.error("--warmup and --steps must be >= 1")
    if args.ladder:
        return run_ladder(args, overrides)
    os.environ.setdefault("WANDB_MODE", "offline")
    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)
    result = run_one(overrides, args.warmup, args.steps, args.label, args.peak_budget)
    if result is not None:
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
