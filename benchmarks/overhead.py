"""The trainer's overhead: its training loop against a minimal hand-written loop.

::

    python benchmarks/overhead.py --steps 5 --rounds 8 -- \\
        --job.config_file train_configs/debug_model.toml

Both loops run in this one process on the same device and threads, on the same model (the
config's model, with the same activation checkpointing and compile applied by the library's own
``apply_*`` functions), the same batches (each reads its own instance of the same data loader)
and the same optimizer (AdamW/Adam with the config's kernel choice), with gradient clipping.
The minimal loop is what a person would write by hand: fetch, forward, cross-entropy, backward,
clip, step. The trainer's loop adds loss bookkeeping, metrics and logging every
``metrics.log_freq`` steps, memory sampling, GC control and whatever else ``Trainer.train``
does.

The two are timed in alternating rounds of ``--steps`` steps after warm-up (keep ``--steps`` a
multiple of ``metrics.log_freq`` so every trainer round holds its share of log steps). Each
trainer round is paired with the minimal round next to it (which goes first alternates), so
the two see nearly the same machine load, and the JSON line reports:

* ``ratio``: the median over the pairs of minimal step time / trainer step time, the trainer's
  throughput as a fraction of the minimal loop's (goal >= 0.97). A pair disturbed by other work
  is outvoted; ``pair_ratios`` shows the spread.
* ``ratio_best``: fastest minimal round / fastest trainer round. Other work on the machine only
  ever adds time, so the fastest round of each loop is its least disturbed one.
* ``cpu_ratio``: like ``ratio`` in process CPU time. Time spent waiting for a core that other
  processes hold is not CPU time, so on a busy machine ``--threads 1`` (no OpenMP spin-waiting)
  with ``cpu_ratio`` is the steadier measurement.
* ``load_avg``/``load_avg_end``: the machine's 1/5/15-minute load averages around the rounds.

One process only (world size 1): parallelism adds communication, not trainer overhead.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from torchtitan.config.manager import split_overrides

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, overrides = split_overrides(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps of each loop first")
    p.add_argument("--steps", type=int, default=5, help="steps per timed round")
    p.add_argument("--rounds", type=int, default=8, help="alternating rounds of each loop")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: default)")
    args = p.parse_args(own)

    import torch

    from torchtitan.data.dataloader import build_dataloader
    from torchtitan.distributed.activation_checkpoint import apply_ac
    from torchtitan.distributed.compile import apply_compile
    from torchtitan.distributed.utils import destroy_distributed
    from torchtitan.models import MODELS
    from torchtitan.preflight.validate import load_config
    from torchtitan.training.trainer import Trainer

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    total = args.warmup + args.steps * args.rounds
    cfg = load_config([*overrides, "--training.steps", str(total)])
    t = cfg.training
    if cfg.quantize.dense.float8.enable:
        raise SystemExit("overhead.py compares plain loops; drop --quantize.dense.float8.enable")
    if cfg.model.attn_mask_type != "causal":
        raise SystemExit("overhead.py's minimal loop is causal; drop --model.attn_mask_type")
    trainer = Trainer(cfg)
    if trainer.parallel_dims.world_size != 1 or trainer.grad_accum_steps != 1:
        raise SystemExit("overhead.py runs one process without gradient accumulation")
    device = trainer.device

    # ---- the minimal loop's own model, optimizer and data
    spec = MODELS[cfg.model.name]
    model = spec.build(trainer.model_args).to(device)
    model.init_weights(seed=cfg.debug.seed, buffer_device=device)  # type: ignore[operator]
    blocks = spec.parallel_plan(trainer.model_args).blocks_of(model)
    apply_ac(blocks, cfg.activation_checkpoint.mode, cfg.activation_checkpoint.selective_ac_option)
    if cfg.compile.enable and "model" in cfg.compile.components:
        apply_compile(blocks, backend=cfg.compile.backend)
    o = cfg.optimizer
    opt_cls = torch.optim.AdamW if o.name == "AdamW" else torch.optim.Adam
    impl = {"fused": {"fused": True}, "foreach": {"foreach": True}}.get(
        o.implementation, {"foreach": False, "fused": False}
    )
    opt = opt_cls(
        model.parameters(),
        lr=o.lr,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
        weight_decay=o.weight_decay,
        **impl,  # type: ignore[arg-type]
    )
    loader = build_dataloader(
        dataset=t.dataset,
        dataset_path=t.dataset_path,
        tokenizer=trainer.tokenizer,
        seq_len=t.seq_len,
        local_batch_size=t.local_batch_size,
        dp_rank=0,
        dp_world_size=1,
        sharding=t.data_sharding,
    )
    data = iter(loader)
    loss_fn = trainer.loss.loss_fn  # the same (possibly compiled) loss function: a token sum

    def minimal_steps(n: int) -> None:
        for _ in range(n):
            inputs, labels = next(data)
            inputs, labels = inputs.to(device), labels.to(device)
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(inputs), labels) / labels.numel()  # the mean, as the trainer's
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_norm)
            opt.step()

    def trainer_steps(n: int) -> None:
        cfg.training.steps = trainer.step + n
        trainer.train()

    cpu: dict[str, list[float]] = {"ours": [], "minimal": []}

    def timed(fn, n: int) -> float:  # type: ignore[no-untyped-def]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start, start_cpu = time.perf_counter(), time.process_time()
        fn(n)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        key = "ours" if fn is trainer_steps else "minimal"
        cpu[key].append((time.process_time() - start_cpu) / n)
        return (time.perf_counter() - start) / n

    try:
        trainer_steps(args.warmup)
        minimal_steps(args.warmup)
        load_start = os.getloadavg()
        ours, minimal = [], []
        for r in range(args.rounds):
            # Alternate which loop goes first, so neither always follows the other.
            if r % 2 == 0:
                ours.append(timed(trainer_steps, args.steps))
                minimal.append(timed(minimal_steps, args.steps))
            else:
                minimal.append(timed(minimal_steps, args.steps))
                ours.append(timed(trainer_steps, args.steps))
        load_end = os.getloadavg()
    finally:
        trainer.close()
        destroy_distributed()
    ours_s, minimal_s = statistics.median(ours), statistics.median(minimal)
    pair_ratios = [m / o for o, m in zip(ours, minimal)]
    cpu_pairs = [m / o for o, m in zip(cpu["ours"], cpu["minimal"])]
    print(
        json.dumps(
            {
                "ratio": round(statistics.median(pair_ratios), 4),
                "ratio_best": round(min(minimal) / min(ours), 4),
                "pair_ratios": [round(r, 4) for r in pair_ratios],
                "cpu_ratio": round(statistics.median(cpu_pairs), 4),
                "cpu_pair_ratios": [round(r, 4) for r in cpu_pairs],
                "trainer_cpu_step_s": round(statistics.median(cpu["ours"][-args.rounds :]), 5),
                "minimal_cpu_step_s": round(statistics.median(cpu["minimal"][-args.rounds :]), 5),
                "trainer_step_s": round(ours_s, 5),
                "minimal_step_s": round(minimal_s, 5),
                "trainer_rounds_s": [round(x, 5) for x in ours],
                "minimal_rounds_s": [round(x, 5) for x in minimal],
                "steps_per_round": args.steps,
                "log_freq": cfg.metrics.log_freq,
                "device": device.type,
                "threads": torch.get_num_threads(),
                "torch": torch.__version__,
                "load_avg": [round(x, 2) for x in load_start],
                "load_avg_end": [round(x, 2) for x in load_end],
                "overrides": overrides,
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
