"""Time to first step of ``python -m torchtitan.train``, one process on this machine's device.

    python benchmarks/startup.py [--cases debug,debug_hf,1B_hf] [--code DIR] [--dir /tmp]

Each case runs the trainer for one step (``--metrics.log_freq 1``) in a fresh interpreter and
reports the wall time from launch to the first step's metrics line (measured from outside, so
it works for any checkout: ``--code /path/to/other/checkout`` gives the "before" figure) and,
when the trainer logs it, its own breakdown (``tools/startup.py``: imports, preflight, process
group, data, meta build, parallelize, materialize/init, optimizer, checkpoint load, first step,
torch.compile). Cases:

- ``debug``: the debug model from random weights;
- ``debug_hf``: the same, initial weights from a Hugging Face folder (``initial_load_in_hf``);
- ``1B_hf``: the Llama 3 ``1B`` flavor with the test tokenizer's vocabulary, bf16 master
  weights, initial weights from a synthetic bf16 Hugging Face checkpoint (written first, into
  ``--dir``, deleted at the end); the model-only export of the last step is written after
  the first step and not timed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE = [
    "--job.config_file",
    "train_configs/debug_model.toml",
    "--training.steps",
    "1",
    "--metrics.log_freq",
    "1",
    "--metrics.no-enable_tensorboard",
    "--training.seq_len",
    "128",
    "--training.local_batch_size",
    "2",
    "--training.global_batch_size",
    "2",
]
_REPORT = re.compile(r"time to first step .*")
_FIRST_STEP = re.compile(r"step\s+1\s+loss")


def _hf_folder(flavor: str, out: Path) -> Path:
    """A synthetic HF checkpoint of llama3 ``flavor`` with the test tokenizer's vocabulary."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.hf_io import write_synthetic
    from torchtitan.models import MODELS

    flavors = MODELS["llama3"].flavors
    args = dataclasses.replace(flavors[flavor], vocab_size=2048)
    flavors["_startup"] = args  # type: ignore[index]
    try:
        write_synthetic("_startup", out, 5 * 10**9)
    finally:
        del flavors["_startup"]  # type: ignore[attr-defined]
    return out


def run(argv: list[str], code: Path, dump: Path) -> dict:
    env = dict(
        os.environ, PYTHONPATH=str(code), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1")
    )
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29600 + os.getpid() % 300))
    cmd = [sys.executable, "-m", "torchtitan.train", *BASE, "--job.dump_folder", str(dump), *argv]
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=code, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    first, report, tail = None, None, []
    assert proc.stdout is not None
    for line in proc.stdout:
        tail = [*tail[-20:], line]
        if first is None and _FIRST_STEP.search(line):
            first = time.perf_counter() - t0
        if (found := _REPORT.search(line)) is not None:
            report = found.group(0)
    if proc.wait() != 0 or first is None:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{''.join(tail)}")
    return {
        "to_first_step_s": round(first, 2),
        "exit_s": round(time.perf_counter() - t0, 2),
        "breakdown": report,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--cases", default="debug,debug_hf,1B_hf")
    p.add_argument("--code", type=Path, default=ROOT, help="the checkout to time")
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    a = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="startup_bench_", dir=a.dir))
    try:
        for case in a.cases.split(","):
            extra: list[str] = []
            if case.endswith("_hf"):
                flavor = "debugmodel" if case == "debug_hf" else case.removesuffix("_hf")
                hf = work / f"hf_{flavor}"
                if not hf.exists():
                    _hf_folder(flavor, hf)
                ck = ["--checkpoint.enable", "--checkpoint.initial_load_path", str(hf)]
                extra += [*ck, "--checkpoint.initial_load_in_hf"]
                extra += [
                    "--checkpoint.last_save_model_only",
                    "--checkpoint.export_dtype",
                    "bfloat16",
                ]
                if flavor != "debugmodel":
                    extra += [
                        "--model.flavor",
                        flavor,
                        "--optimizer.master_weights_dtype",
                        "bfloat16",
                        "--training.seq_len",
                        "64",
                        "--training.local_batch_size",
                        "1",
                        "--training.global_batch_size",
                        "1",
                    ]
            result = run(extra, a.code.resolve(), work / f"dump_{case}")
            print(json.dumps({"case": case, "code": str(a.code), **result}), flush=True)
            shutil.rmtree(work / f"dump_{case}", ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
