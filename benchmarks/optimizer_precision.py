"""Low-precision optimizer state against fp32 over a long run (docs/memory.md).

::

    python benchmarks/optimizer_precision.py --steps 200

Trains the debug model (one process each, fp32 compute, ``--local_batch_size`` sequences of 64
tokens per step) side by side from the same seed and data: fp32 Adam moments (the reference), bf16 moments, and bf16
master weights (fp32 moments). Each run is a plain ``python -m torchtitan.train`` subprocess
writing its metrics as JSONL. Prints one JSON line: the final loss of each run, the mean loss of
the last 20 steps, each one's relative difference from the reference (goal <= 1%), and the
optimizer-state bytes of each (the moments of every parameter).
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

RUNS = {
    "fp32": [],
    "bf16_moments": ["--optimizer.moments_dtype", "bfloat16"],
    "bf16_master_weights": [
        "--optimizer.master_weights_dtype",
        "bfloat16",
        "--training.mixed_precision_param",
        "bfloat16",
    ],
}


def _start(extra: list[str], steps: int, batch: int, dump: Path) -> subprocess.Popen:
    argv = [
        "--job.config_file",
        "train_configs/debug_model.toml",
        "--job.dump_folder",
        str(dump),
        "--training.steps",
        str(steps),
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        str(batch),
        "--training.mixed_precision_param",
        "float32",
        "--metrics.log_freq",
        "1",
        "--metrics.no-enable_tensorboard",
        *extra,
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torchtitan.train", *argv]
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )


def _metrics(dump: Path) -> list[dict]:
    lines = (dump / "metrics" / "rank_0.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _state_bytes(extra: list[str]) -> int:
    """Bytes of the Adam moments of the debug model under ``extra`` (its runtime args)."""
    from torchtitan.models import MODELS
    from torchtitan.planner.estimator import optimizer_state_bytes_per_param

    spec = MODELS["llama3"]
    n = spec.num_params(spec.flavors["debugmodel"])
    moments = extra[1] if extra and extra[0] == "--optimizer.moments_dtype" else "float32"
    return n * optimizer_state_bytes_per_param(moments)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--local_batch_size", type=int, default=8)
    p.add_argument(
        "--runs",
        default=",".join(RUNS),
        help="comma-separated subset of the runs (fp32 is always run: the reference)",
    )
    args = p.parse_args(argv)
    names = ["fp32", *(n for n in args.runs.split(",") if n != "fp32")]
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        # The runs are independent: run them side by side.
        procs = {
            n: _start(RUNS[n], args.steps, args.local_batch_size, Path(tmp) / n) for n in names
        }
        for name, proc in procs.items():
            _, err = proc.communicate()
            if proc.returncode != 0:
                raise RuntimeError(f"{name} failed:\n{err.decode()[-3000:]}")
        for name in names:
            extra = RUNS[name]
            metrics = _metrics(Path(tmp) / name)
            tail = [m["loss"] for m in metrics[-20:]]
            out[name] = {
                "final_loss": metrics[-1]["loss"],
                "last20_mean_loss": sum(tail) / len(tail),
                "optimizer_state_bytes": _state_bytes(extra),
            }
    ref = out["fp32"]
    for r in out.values():
        for key in ("final_loss", "last20_mean_loss"):
            r[f"{key}_rel_diff"] = abs(r[key] - ref[key]) / ref[key]
    print(json.dumps({"steps": args.steps, "local_batch_size": args.local_batch_size, "runs": out}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
