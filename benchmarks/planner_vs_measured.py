"""The planner's ranking against measured speed, on 2 CPU ranks (docs/planning.md).

::

    python benchmarks/planner_vs_measured.py [--flavors debugmodel,cpu_large] [--rounds 3]

Two gloo ranks (one per core, one thread each) measure this machine first: the fp32 matmul rate
of one core (both cores busy, as in training), the gloo all-gather bandwidth and the latency of
a small collective; that is the planner's ``Hardware`` (``planner/auto.py: CPU_GLOO`` with the
measured figures). Then, for each flavor (the debug model; ``cpu_large`` of
``benchmarks/memory_levers.py``), every layout of 2 ranks (the planner's own enumeration: FSDP,
DDP, TP, PP 1F1B and Interleaved1F1B, plus CP 2 and PP GPipe, which it does not enumerate at
this sequence length), each with the four AC modes, trains a few real steps with the real
trainer. The global batch is the same for all (8 sequences of 128 tokens).

The cores may be shared with other work, so the layouts are measured in interleaved rounds
(A, B, C, ... then again, every other round in reverse order) and each layout keeps its best
(minimum) step time over all timed steps of all rounds. The output: one JSON line per layout,
then a Markdown table (predicted and measured tokens/s per device), the Spearman rank
correlation of the two per flavor, and the layout ``--parallelism.auto`` chooses against the
fastest measured one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEQ, GLOBAL_BATCH, WORLD = 128, 8, 2


def _base_argv(flavor: str, dump: str) -> list[str]:
    return [
        "--job.config_file",
        str(ROOT / "train_configs" / "debug_model.toml"),
        "--model.flavor",
        flavor,
        "--training.seq_len",
        str(SEQ),
        "--training.local_batch_size",
        str(GLOBAL_BATCH // WORLD),
        "--metrics.log_freq",
        "1000",
        "--no-metrics.enable_tensorboard",
        "--no-metrics.enable_jsonl",
        "--job.dump_folder",
        dump,
    ]


def measure_hardware():  # type: ignore[no-untyped-def]
    """This machine as the planner's Hardware: matmul rate, gloo bandwidth and latency."""
    import torch
    import torch.distributed as dist

    from torchtitan.planner.auto import hardware_facts
    from torchtitan.tools.peak_flops import measure_matmul_peak_flops

    dist.barrier()
    peak = measure_matmul_peak_flops(torch.device("cpu"), torch.float32, budget_s=3.0)
    peak_t = torch.tensor([peak])
    dist.all_reduce(peak_t, op=dist.ReduceOp.MAX)  # the less disturbed core
    shard = torch.ones(2 * 1024 * 1024)  # 8 MB per rank
    out = torch.empty(WORLD * shard.numel())
    small = torch.ones(1)
    gather_s, scatter_s, small_s = [], [], []
    for _ in range(8):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_gather_into_tensor(out, shard)
        gather_s.append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        dist.reduce_scatter_tensor(shard, out)  # the same bytes on the wire as the gather
        scatter_s.append(time.perf_counter() - t0)
        for _ in range(20):
            t0 = time.perf_counter()
            dist.all_reduce(small)
            small_s.append(time.perf_counter() - t0)
    # Typical figures (medians), not the best: on shared cores a collective waits for the peer
    # to be scheduled, and a training step pays that at every one of its collectives.
    found = torch.tensor(
        [statistics.median(gather_s), statistics.median(scatter_s), statistics.median(small_s)]
    )
    dist.all_reduce(found, op=dist.ReduceOp.MAX)
    gather, scatter, latency = (float(v) for v in found)
    # The optimizer step: fused AdamW over 4M fp32 parameters, both cores busy.
    param = torch.nn.Parameter(torch.randn(4 * 1024 * 1024))
    param.grad = torch.randn_like(param)
    opt = torch.optim.AdamW([param], lr=1e-4, fused=True)
    opt_s = []
    for _ in range(6):
        dist.barrier()
        t0 = time.perf_counter()
        opt.step()
        opt_s.append(time.perf_counter() - t0)
    opt_t = torch.tensor([statistics.median(opt_s[1:])])
    dist.all_reduce(opt_t, op=dist.ReduceOp.MAX)
    optimizer_gbps = param.numel() * 16 / float(opt_t) / 1e9
    sync = _sync_seconds()
    gbps = out.numel() * 4 * (WORLD - 1) / WORLD / max(gather - latency, 1e-9) / 1e9
    # one host: a group "across nodes" is on the same host too
    return dataclasses.replace(
        hardware_facts(WORLD),
        peak_tflops=float(peak_t) / 1e12,
        intra_node_gbps=round(gbps, 3),
        inter_node_gbps=round(gbps, 3),
        intra_latency_us=round(latency * 1e6, 1),
        inter_latency_us=round(latency * 1e6, 1),
        reduce_scatter_factor=round(scatter / gather, 2),
        optimizer_gbps=round(optimizer_gbps, 3),
        sync_us=round(sync * 1e6, 1),
    )


def _sync_seconds(n: int = 40) -> float:
    """What a collective costs between two computations beyond the same collective back to
    back: the ranks' skew (the later one sets the pace) and the waiting rank's wake-up.

    Three loops of ``n``: a ~1 ms matmul alone, a small all-reduce alone, and the two
    alternating, as a tensor-parallel block alternates them; the median of five repeats of
    (alternating - matmul - all-reduce) / n, the larger of the two ranks' figures."""
    import torch
    import torch.distributed as dist

    a, b, small = torch.randn(256, 512), torch.randn(512, 512), torch.ones(1)

    def loop(compute: bool, collective: bool) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            if compute:
                a @ b
            if collective:
                dist.all_reduce(small)
        return time.perf_counter() - t0

    loop(True, True)  # warm-up
    found = []
    for _ in range(5):
        both, alone, coll = loop(True, True), loop(True, False), loop(False, True)
        found.append(max(0.0, both - alone - coll) / n)
    t = torch.tensor([statistics.median(found)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def layouts_for(cfg, hw):  # type: ignore[no-untyped-def]
    """The planner's layouts without gradient accumulation, plus CP 2 and PP GPipe."""
    from torchtitan.planner.estimator import model_args_for
    from torchtitan.planner.planner import AC_CHOICES, enumerate_layouts

    own = [
        lay
        for lay in enumerate_layouts(cfg, model_args_for(cfg), WORLD, hw)
        if lay.accumulation == 1
    ]
    extra = []
    for mode, option in AC_CHOICES:
        fsdp = next(lay for lay in own if lay.dp_shard == WORLD and lay.ac_mode == mode)
        cp = dataclasses.replace(
            fsdp, dp_shard=1, cp=WORLD, local_batch_size=GLOBAL_BATCH, ac_option=option
        )
        pp = next(lay for lay in own if lay.pp == WORLD and lay.schedule == "1F1B")
        gpipe = dataclasses.replace(pp, schedule="GPipe", ac_mode=mode, ac_option=option)
        extra += [cp, gpipe]
    return own + extra


def time_layout(flavor: str, layout, warmup: int, steps: int, dump: str) -> float:  # type: ignore[no-untyped-def]
    """Best step time (s) of ``steps`` timed steps after ``warmup``, rank 0's clock."""
    from torchtitan.preflight.validate import load_config
    from torchtitan.training.trainer import Trainer

    argv = [*_base_argv(flavor, dump), *" ".join(layout.overrides()).split()]
    cfg = load_config([*argv, "--training.steps", str(warmup + steps)], world_size=WORLD)
    trainer = Trainer(cfg)
    stamps: list[float] = []
    end_step = trainer.metrics.end_step

    def stamp(*args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        end_step(*args, **kwargs)
        stamps.append(time.perf_counter())

    trainer.metrics.end_step = stamp  # type: ignore[method-assign]
    try:
        trainer.train()
    finally:
        trainer.close()
    return min(b - a for a, b in zip(stamps[warmup - 1 :], stamps[warmup:]))


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from torchtitan.config.manager import parse_args
    from torchtitan.training import builders

    register_flavors()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    hw = measure_hardware()
    if args.hardware_only:  # measure the machine again, keep the layouts' times
        if rank == 0:
            record = json.loads(Path(args.out).read_text())
            record["hardware"] = dataclasses.asdict(hw)
            Path(args.out).write_text(json.dumps(record, indent=1))
        dist.destroy_process_group()
        return
    # The trainer's MFU peak: the one measured above, not a matmul timed at every build.
    builders.measure_matmul_peak_flops = lambda *a, **k: hw.peak_tflops * 1e12
    dump = tempfile.mkdtemp(prefix="planner_vs_measured_")
    cases = []
    for flavor in args.flavors.split(","):
        cfg = parse_args(_base_argv(flavor, dump))
        cases += [{"flavor": flavor, "layout": lay, "best_s": 1e9} for lay in layouts_for(cfg, hw)]
    machines = [hw]
    for r in range(args.rounds):
        for case in cases if r % 2 == 0 else cases[::-1]:
            s = time_layout(case["flavor"], case["layout"], args.warmup, args.steps, dump)
            case["best_s"] = min(case["best_s"], s)
            if rank == 0:
                print(
                    f"round {r} {case['flavor']} {case['layout'].describe()}: {s:.3f} s", flush=True
                )
        machines.append(measure_hardware())  # the machine between rounds, too
    # each figure's median over the measurements before, between and after the rounds
    numbers = [f.name for f in dataclasses.fields(hw) if isinstance(getattr(hw, f.name), float)]
    hw = dataclasses.replace(
        hw, **{n: statistics.median(getattr(m, n) for m in machines) for n in numbers}
    )
    if rank == 0:
        for case in cases:
            case["layout"] = dataclasses.asdict(case["layout"])
        record = {"hardware": dataclasses.asdict(hw), "load_avg": os.getloadavg(), "cases": cases}
        if args.merge and Path(args.out).is_file():  # more rounds: each layout's best of all
            old = json.loads(Path(args.out).read_text())
            earlier = {(c["flavor"], json.dumps(c["layout"])): c["best_s"] for c in old["cases"]}
            for c in cases:
                c["best_s"] = min(
                    c["best_s"], earlier.pop((c["flavor"], json.dumps(c["layout"])), 1e9)
                )
            for c in old["cases"]:  # layouts of flavors not re-measured
                if (c["flavor"], json.dumps(c["layout"])) in earlier:
                    cases.append(c)
        Path(args.out).write_text(json.dumps(record, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def register_flavors() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from memory_levers import register_flavors as register

    register()


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=v.__getitem__)
        out = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var


def _matches(lay, auto) -> bool:  # type: ignore[no-untyped-def]
    p, ac = auto
    return (
        lay.dp_replicate == p.data_parallel_replicate_degree
        and lay.dp_shard == p.data_parallel_shard_degree
        and lay.tp == p.tensor_parallel_degree
        and lay.pp == p.pipeline_parallel_degree
        and lay.cp == p.context_parallel_degree
        and (lay.pp == 1 or lay.schedule == p.pipeline_parallel_schedule)
        and lay.ac_mode == ac.mode
        and (lay.ac_mode != "selective" or lay.ac_option == ac.selective_ac_option)
    )


def report(path: str) -> None:
    """Predictions of the current cost model beside the measurements saved in ``path``."""
    from torchtitan.config.manager import parse_args
    from torchtitan.planner.auto import choose
    from torchtitan.planner.cost_model import step_time
    from torchtitan.planner.estimator import model_args_for
    from torchtitan.planner.layout import Hardware, Layout

    register_flavors()
    record = json.loads(Path(path).read_text())
    hw = Hardware(**record["hardware"])
    tokens = GLOBAL_BATCH * SEQ / WORLD
    print(json.dumps({"hardware": record["hardware"], "load_avg": record["load_avg"]}))
    lines = [
        "| flavor | layout | predicted tok/s | measured tok/s | predicted rank | measured rank |"
    ]
    lines.append("|---|---|---|---|---|---|")
    summary = []
    for flavor in dict.fromkeys(c["flavor"] for c in record["cases"]):
        cfg = parse_args(_base_argv(flavor, "/tmp"))
        args = model_args_for(cfg)
        mine = [
            (Layout(**{**c["layout"], "levers": tuple(c["layout"]["levers"])}), c["best_s"])
            for c in record["cases"]
            if c["flavor"] == flavor
        ]
        pred = [tokens / step_time(cfg, args, lay, hw, WORLD)[0] for lay, _ in mine]
        meas = [tokens / s for _, s in mine]
        p_rank = _ranks(pred)
        m_rank = _ranks(meas)
        for i in sorted(range(len(mine)), key=lambda i: -meas[i]):
            lay = mine[i][0]
            desc = lay.describe()
            lines.append(
                f"| {flavor} | {desc} | {pred[i]:,.0f} | {meas[i]:,.0f} | {p_rank[i]} | {m_rank[i]} |"
            )
        chosen, _ = choose(
            parse_args([*_base_argv(flavor, "/tmp"), "--parallelism.auto"]), WORLD, hw
        )
        auto = (chosen.parallelism, chosen.activation_checkpoint)
        picked = [(mine[i][0], meas[i]) for i in range(len(mine)) if _matches(mine[i][0], auto)]
        best = max(meas)
        summary.append(
            f"{flavor}: Spearman {spearman(pred, meas):.2f} over {len(mine)} layouts; "
            f"--parallelism.auto chooses {picked[0][0].describe()}, measured "
            f"{picked[0][1]:,.0f} tok/s, {1 - picked[0][1] / best:.1%} below the fastest "
            f"({mine[meas.index(best)][0].describe()}, {best:,.0f} tok/s)"
        )
    print("\n".join(lines))
    print("\n".join(summary))


def _ranks(values: list[float]) -> list[int]:
    """1 for the fastest."""
    order = sorted(range(len(values)), key=lambda i: -values[i])
    out = [0] * len(values)
    for r, i in enumerate(order, start=1):
        out[i] = r
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--flavors", default="debugmodel,cpu_large")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default="planner_vs_measured.json", help="measurements (JSON)")
    ap.add_argument(
        "--merge", action="store_true", help="keep the best of these and --out's rounds"
    )
    ap.add_argument(
        "--hardware_only", action="store_true", help="re-measure the machine into --out only"
    )
    ap.add_argument("--report", metavar="JSON", help="only print the table for saved measurements")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.report:
        report(args.report)
        return 0
    if args.worker:
        worker(args)
        return 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHTITAN_DEVICE": "cpu"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={WORLD}",
    ]
    cmd += [__file__, "--worker", *(argv if argv is not None else sys.argv[1:])]
    code = subprocess.run(cmd, env=env, cwd=ROOT, check=False).returncode
    if code == 0:
        report(args.out)
    return code


if __name__ == "__main__":
    sys.exit(main())
