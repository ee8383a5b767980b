"""Each memory lever's saving, measured against the estimator's prediction (docs/planning.md).

::

    python benchmarks/memory_levers.py [--models debugmodel,cpu_large] [--levers ...]

For each model (the debug model; ``cpu_large``: dim 512, 8 layers, GQA, the flavor the
estimator's calibration test uses; ``cpu_vocab_heavy``: dim 64, 2 layers, where the loss over the
2048-token vocabulary is the peak) and each lever, one process trains a few fp32 steps (seq 64,
8 sequences) under ``LiveTensorTracker`` and reports the steady-state peak of live tensor
memory; the estimator (``device_type="cpu"``) predicts the same peak. The lever's saving is
``base - lever``, measured and estimated, and the JSON line gives their relative difference
(goal <= 10%). Every case runs in a subprocess of its own (a fresh process group).

CPU offload is not in the list: on a CPU-only machine the "offloaded" shards are in the same
memory the tracker follows, so there is no device saving to measure here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

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
]
LEVERS = {
    "base": [],
    "chunked_loss_128": ["--training.loss_chunk_size", "128"],
    "bf16_moments": ["--optimizer.moments_dtype", "bfloat16"],
    "bf16_master_weights": [
        "--optimizer.master_weights_dtype",
        "bfloat16",
        "--training.mixed_precision_param",
        "bfloat16",
    ],
}


def _register_cpu_large() -> None:
    from torchtitan.models.llama3.args import LLAMA3_FLAVORS, ModelArgs

    LLAMA3_FLAVORS["cpu_large"] = ModelArgs(
        dim=512,
        n_layers=8,
        n_heads=8,
        n_kv_heads=2,
        vocab_size=2048,
        ffn_dim_multiplier=1.3,
        multiple_of=256,
        max_seq_len=2048,
    )
    # Narrow and shallow: the loss (vocabulary 2048 x 1024 tokens) is the peak.
    LLAMA3_FLAVORS["cpu_vocab_heavy"] = ModelArgs(
        dim=64, n_layers=2, n_heads=4, vocab_size=2048, max_seq_len=2048
    )


def _case(argv: list[str], steps: int) -> dict:
    """Measured steady-state peak and the estimate for one config (in this process)."""
    _register_cpu_large()
    from torchtitan.plan.estimator import estimate_memory
    from torchtitan.plan.tracker import LiveTensorTracker
    from torchtitan.preflight.validate import load_config
    from torchtitan.trainer import Trainer

    cfg = load_config(argv)
    trainer = Trainer(cfg)
    held = [p for part in trainer.model_parts for p in [*part.parameters(), *part.buffers()]]
    peaks = []
    with LiveTensorTracker() as tracker:
        tracker.add(held)
        for _ in range(steps):
            tracker.reset_peak()
            trainer.step += 1
            trainer.train_step()
            peaks.append(tracker.peak)
    trainer.close()
    est = estimate_memory(load_config(argv), 1, device_type="cpu")
    return {"measured": max(peaks[1:]), "estimated": est.tensor_peak, "phase": est.phase}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", default="debugmodel,cpu_large,cpu_vocab_heavy")
    p.add_argument("--levers", default=",".join(n for n in LEVERS if n != "base"))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case, print its JSON
    args = p.parse_args(argv)
    if args.case:
        print("RESULT " + json.dumps(_case(json.loads(args.case), args.steps)))
        return 0
    rows = []
    for model in args.models.split(","):
        results = {}
        for lever in ["base", *args.levers.split(",")]:
            with tempfile.TemporaryDirectory() as tmp:
                case = [*BASE, "--model.flavor", model, "--job.dump_folder", tmp, *LEVERS[lever]]
                cmd = [sys.executable, __file__, "--steps", str(args.steps), "--case"]
                env = {**os.environ, "PYTHONPATH": str(ROOT)}
                run = subprocess.run(
                    [*cmd, json.dumps(case)], capture_output=True, text=True, env=env, cwd=ROOT
                )
                line = [x for x in run.stdout.splitlines() if x.startswith("RESULT ")]
                if run.returncode != 0 or not line:
                    raise RuntimeError(f"{model} {lever} failed:\n{run.stderr[-3000:]}")
                results[lever] = json.loads(line[-1][len("RESULT ") :])
        base = results.pop("base")
        for lever, r in results.items():
            saved_m = base["measured"] - r["measured"]
            saved_e = base["estimated"] - r["estimated"]
            rows.append(
                {
                    "model": model,
                    "lever": lever,
                    "base_measured_mib": base["measured"] / 2**20,
                    "base_estimated_mib": base["estimated"] / 2**20,
                    "measured_mib": r["measured"] / 2**20,
                    "estimated_mib": r["estimated"] / 2**20,
                    "saving_measured_mib": saved_m / 2**20,
                    "saving_estimated_mib": saved_e / 2**20,
                    "saving_rel_diff": (saved_e - saved_m) / saved_m if saved_m else None,
                    "phase": r["phase"],
                }
            )
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
