#!/usr/bin/env python3
"""Compare two training runs step by step: losses side by side, their difference, a verdict.

Two JSONL metric files (``<dump_folder>/metrics/rank_<r>.jsonl``, one object per log step)::

    python scripts/loss_compare.py outputs/a/metrics/rank_0.jsonl outputs/b/metrics/rank_0.jsonl

Or run the same config twice through ``run_train.sh``, with two sets of overrides::

    python scripts/loss_compare.py --steps 20 \\
        --a "--training.local_batch_size 8" --ngpu-a 1 \\
        --b "--parallelism.tensor_parallel_degree 2" --ngpu-b 2 \\
        --common "--training.seq_len 64 --training.mixed_precision_param float32"

Both runs log every step (``--metrics.log_freq 1``) into ``--out`` (default: a new temporary
folder), ``a/`` and ``b/``, with their console output in ``a.log`` / ``b.log``.

Exit status: 0 when every step agrees within the tolerance (``|a - b| <= atol + rtol * |a|``),
1 when a step differs by more or a step is missing from one side, 2 on bad input or a failed run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class InputError(Exception):
    """Bad arguments, unreadable metrics or a failed run (exit status 2)."""


@dataclass
class Comparison:
    metric: str
    rows: list[tuple[int, float, float]]
    """(step, value A, value B) for the steps present in both."""
    only_a: list[int] = field(default_factory=list)
    only_b: list[int] = field(default_factory=list)

    def diffs(self) -> list[tuple[int, float, float]]:
        """(step, |a - b|, relative difference |a - b| / |a|) per common step."""
        out = []
        for step, a, b in self.rows:
            d = abs(a - b)
            if math.isnan(a) or math.isnan(b):
                d = 0.0 if math.isnan(a) and math.isnan(b) else math.inf
            out.append((step, d, d / abs(a) if a != 0 else (0.0 if d == 0 else math.inf)))
        return out

    def failures(self, rtol: float, atol: float) -> list[int]:
        """Steps outside the tolerance."""
        return [
            step
            for (step, a, _), (_, d, _) in zip(self.rows, self.diffs())
            if not d <= atol + rtol * abs(a)
        ]

    def worst(self) -> tuple[int, float, float] | None:
        """(step, |a - b|, relative) of the largest relative difference."""
        diffs = self.diffs()
        return max(diffs, key=lambda x: (x[2], x[1])) if diffs else None


def read_metrics(path: Path) -> list[dict]:
    """The JSON objects of a metrics file, or of the lowest-rank file in a run's dump folder."""
    if path.is_dir():
        files = sorted(
            (path / "metrics").glob("rank_*.jsonl"),
            key=lambda p: int(p.stem.removeprefix("rank_")),
        )
        if not files:
            raise InputError(f"no metrics/rank_*.jsonl under {path}")
        path = files[0]
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise InputError(f"cannot read {path}: {e}") from None
    records = []
    for n, line in enumerate(lines, start=1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise InputError(f"{path}:{n}: not JSON ({e})") from None
    return records


def compare(a: list[dict], b: list[dict], metric: str = "loss") -> Comparison:
    """Pair the two runs' values of ``metric`` by step."""

    def by_step(records: list[dict], side: str) -> dict[int, float]:
        values = {}
        for r in records:
            if "step" in r and r.get(metric) is not None:
                values[int(r["step"])] = float(r[metric])
        if not values:
            raise InputError(f"run {side} has no '{metric}' values")
        return values

    va, vb = by_step(a, "A"), by_step(b, "B")
    common = sorted(va.keys() & vb.keys())
    return Comparison(
        metric=metric,
        rows=[(s, va[s], vb[s]) for s in common],
        only_a=sorted(va.keys() - vb.keys()),
        only_b=sorted(vb.keys() - va.keys()),
    )


def format_report(c: Comparison, rtol: float, atol: float) -> str:
    la, lb = (f"{c.metric} {x}"[-14:] for x in "AB")
    failed = set(c.failures(rtol, atol))
    lines = [f"{'step':>6}  {la:>14}  {lb:>14}  {'|a - b|':>10}  {'relative':>10}"]
    for (step, a, b), (_, d, rel) in zip(c.rows, c.diffs()):
        mark = "  <-- over tolerance" if step in failed else ""
        lines.append(f"{step:>6}  {a:>14.7f}  {b:>14.7f}  {d:>10.3e}  {rel:>10.3e}{mark}")
    for side, steps in (("A", c.only_a), ("B", c.only_b)):
        if steps:
            lines.append(f"steps only in run {side}: {', '.join(map(str, steps))}")
    worst = c.worst()
    if worst is not None:
        step, d, rel = worst
        verdict = "OK" if not failed and not (c.only_a or c.only_b) else "FAIL"
        lines.append(
            f"worst: step {step}, |a - b| = {d:.3e}, relative {rel:.3e} over {len(c.rows)} "
            f"steps; tolerance atol {atol:g} + rtol {rtol:g} x |a|: {verdict}"
            + (f" ({len(failed)} steps over)" if failed else "")
        )
    return "\n".join(lines)


def run_once(
    name: str, overrides: list[str], ngpu: int, config: str, steps: int, out: Path
) -> Path:
    """Train through run_train.sh with ``overrides``; returns the run's dump folder."""
    dump = out / name
    argv = [
        str(ROOT / "run_train.sh"),
        "--job.dump_folder",
        str(dump),
        "--training.steps",
        str(steps),
        "--metrics.log_freq",
        "1",
        "--metrics.enable_jsonl",
        *overrides,
    ]
    env = dict(
        os.environ, NGPU=str(ngpu), CONFIG_FILE=config, LOG_RANK=os.environ.get("LOG_RANK", "0")
    )
    env.setdefault("TORCHTITAN_PYTHON", sys.executable)
    log = out / f"{name}.log"
    print(f"run {name}: NGPU={ngpu} {' '.join(shlex.quote(x) for x in argv)}", flush=True)
    with log.open("w") as f:
        rc = subprocess.run(argv, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        tail = "\n".join(log.read_text().splitlines()[-20:])
        raise InputError(f"run {name} exited {rc}; last lines of {log}:\n{tail}")
    return dump


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("files", nargs="*", type=Path, help="two metrics JSONL files (or dump folders)")
    p.add_argument("--a", default="", help="overrides of run A (one string, shell-quoted)")
    p.add_argument("--b", default="", help="overrides of run B")
    p.add_argument("--common", default="", help="overrides of both runs")
    p.add_argument("--ngpu-a", type=int, default=1, help="ranks of run A (default 1)")
    p.add_argument("--ngpu-b", type=int, default=1, help="ranks of run B (default 1)")
    p.add_argument("--config", default=str(ROOT / "train_configs" / "debug_model.toml"))
    p.add_argument("--steps", type=int, default=20, help="steps of each run (default 20)")
    p.add_argument("--out", type=Path, default=None, help="folder for both runs' outputs")
    p.add_argument("--metric", default="loss", help="JSONL key to compare (default loss)")
    p.add_argument("--rtol", type=float, default=1e-5, help="relative tolerance (default 1e-5)")
    p.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default 0)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.files:
            if len(args.files) != 2 or args.a or args.b:
                raise InputError("give two metrics files, or --a/--b overrides to run, not both")
            header = [f"A: {args.files[0]}", f"B: {args.files[1]}"]
            runs = [read_metrics(f) for f in args.files]
        else:
            if not (args.a or args.b):
                raise InputError("give two metrics files, or --a and/or --b overrides to run")
            out = args.out or Path(tempfile.mkdtemp(prefix="loss_compare_"))
            out.mkdir(parents=True, exist_ok=True)
            common = shlex.split(args.common)
            runs = []
            for name, extra, ngpu in (("a", args.a, args.ngpu_a), ("b", args.b, args.ngpu_b)):
                dump = run_once(
                    name, common + shlex.split(extra), ngpu, args.config, args.steps, out
                )
                runs.append(read_metrics(dump))
            header = [
                f"A: NGPU={args.ngpu_a} {args.common} {args.a}".rstrip(),
                f"B: NGPU={args.ngpu_b} {args.common} {args.b}".rstrip(),
            ]
        c = compare(runs[0], runs[1], args.metric)
    except InputError as e:
        print(f"loss_compare: {e}", file=sys.stderr)
        return 2
    if not c.rows:
        print("loss_compare: the two runs have no step in common", file=sys.stderr)
        return 2
    print("\n".join(header))
    print(format_report(c, args.rtol, args.atol))
    return 1 if c.failures(args.rtol, args.atol) or c.only_a or c.only_b else 0


if __name__ == "__main__":
    sys.exit(main())
