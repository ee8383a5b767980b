"""Where one MoE training step's time goes: profiles one forward + backward + optimizer step
of an MoE flavor with torch.profiler and prints the share of each bucket as one JSON line
(docs/performance.md, "Where an MoE step's time goes")::

    python benchmarks/moe_profile.py --family qwen3 --flavor debugmodel_moe --seq_len 256

Buckets: expert GEMMs (the routed experts' grouped GEMMs, with their float8 casts when
``--float8_experts``), expert activation (SwiGLU between them), attention (the attention core;
its projections are dense GEMMs), dense GEMMs (every other matmul: projections, dense and
shared-expert SwiGLUs, the router's gate, the output head), routing (scores, group limit,
weights), top-k, permutation (sort by expert, gather of rows) and un-permutation
(scatter back), padding copies (float8's per-expert alignment: the padded layout's indices
and, for experts that pad their own rows, the zero buffers; the shared layer's float8 experts
gather the rows straight into that layout, under permutation), combine (weighting the
experts' outputs), aux loss, bias update (after the optimizer step), optimizer, other
(embeddings, norms, loss, ...).

How an op is bucketed: each MoE piece runs under a ``record_function`` label (the script wraps
the model's modules; the model is unchanged), forward ops by their nearest label and their name;
a backward op by the forward op that made its autograd node (the profiler's sequence numbers),
so ``IndexAddBackward`` counts as combine, ``TopkBackward`` as top-k. Time: the ops' own device
time on a GPU, their own CPU time elsewhere.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

GEMMS = ("mm", "addmm", "bmm", "matmul", "linear", "_grouped_mm", "_scaled_grouped_mm", "_scaled_mm")  # fmt: skip


def _label(fn: Any, name: str) -> Any:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with record_function(name):
            return fn(*args, **kwargs)

    return wrapped


def instrument(model: torch.nn.Module) -> None:
    """Put each MoE piece (and attention) under a ``record_function`` label."""
    from torchtitan.models.common.moe import MoE

    for module in model.modules():
        if isinstance(module, MoE):
            module.router.forward = _label(module.router.forward, "L:routing")  # type: ignore[method-assign]
            module.experts.forward = _label(module.experts.forward, "L:experts")  # type: ignore[method-assign]
            if hasattr(module.experts, "forward_padded"):  # the float8 dispatch calls it directly
                module.experts.forward_padded = _label(module.experts.forward_padded, "L:experts")  # type: ignore[method-assign]
            module.dispatch_and_combine = _label(module.dispatch_and_combine, "L:dispatch")  # type: ignore[method-assign]
            module._aux_loss = _label(module._aux_loss, "L:aux")  # type: ignore[method-assign]
            if module.shared is not None:
                module.shared.forward = _label(module.shared.forward, "L:shared")  # type: ignore[method-assign]
        if type(module).__name__.endswith("Attention") or hasattr(module, "sdpa"):
            module.forward = _label(module.forward, "L:attention")  # type: ignore[method-assign]
    import torchtitan.distributed.float8_grouped as f8

    f8.pad_groups = _label(f8.pad_groups, "L:padding")
    f8.padded_layout = _label(f8.padded_layout, "L:padding")


def bucket(labels: list[str], op: str) -> str:
    """The bucket of forward op ``op`` (``aten::`` stripped) under ``labels`` (innermost last)."""
    inner = labels[-1] if labels else ""
    gemm = op in GEMMS
    if inner == "L:padding":
        return "padding copies"
    if inner == "L:experts":
        return "expert GEMMs" if gemm or "Float8" in op else "expert activation"
    if inner == "L:routing":
        return "dense GEMMs" if gemm else ("top-k" if op == "topk" else "routing")
    if inner == "L:aux":
        return "aux loss"
    if inner == "L:dispatch":
        if op in ("argsort", "sort", "index", "floor_divide", "div"):
            return "permutation"
        if op in ("index_add_", "index_add", "zeros_like"):
            return "un-permutation"
        return "combine"
    if inner == "L:attention":
        return "dense GEMMs" if gemm else "attention"
    if inner == "L:bias_update":
        return "bias update"
    if inner == "L:optimizer":
        return "optimizer"
    return "dense GEMMs" if gemm else "other"


def split(events: Any, device: str) -> dict[str, float]:
    """Seconds per bucket of the profiled events."""
    by_seq: dict[int, str] = {}
    out: dict[str, float] = defaultdict(float)

    def labels_of(ev: Any) -> tuple[list[str], Any]:
        chain, node, engine = [], ev.cpu_parent, None
        while node is not None:
            if node.name.startswith("L:"):
                chain.append(node.name)
            if node.name.startswith("autograd::engine::evaluate_function"):
                engine = node
            node = node.cpu_parent
        return chain[::-1], engine

    for ev in sorted(events, key=lambda e: e.time_range.start):
        if ev.name.startswith(("L:", "autograd::engine", "ProfilerStep")):
            continue
        labels, engine = labels_of(ev)
        op = ev.name.removeprefix("aten::")
        own = ev.self_device_time_total if device == "cuda" else ev.self_cpu_time_total
        if engine is not None:  # a backward op: the forward op's bucket that made its node
            b = by_seq.get(engine.sequence_nr, "other")
            if "Float8" in engine.name:
                b = "expert GEMMs"
        else:
            b = bucket(labels, op)
            if ev.sequence_nr >= 0:
                by_seq[ev.sequence_nr] = b
        out[b] += own / 1e6
    return dict(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--family", default="qwen3")
    p.add_argument("--flavor", default="debugmodel_moe")
    p.add_argument("--n_layers", type=int, default=-1, help="blocks (-1: the flavor's)")
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--float8_experts", action="store_true")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    a = p.parse_args(argv)
    from torchtitan.distributed.float8_grouped import apply_float8_experts
    from torchtitan.models import MODELS
    from torchtitan.models.common.moe import update_expert_bias

    if a.threads:
        torch.set_num_threads(a.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    spec = MODELS[a.family]
    args = dataclasses.replace(spec.flavors[a.flavor], vocab_size=a.vocab, max_seq_len=a.seq_len)
    if a.n_layers > 0:
        args = args.with_n_layers(a.n_layers)
    with torch.device("meta"):
        model = spec.build(args)
    if a.float8_experts:
        apply_float8_experts(model, emulate=False, device_type=device)
    model.to_empty(device=device)
    model.init_weights(0)
    instrument(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    opt.step = _label(opt.step, "L:optimizer")  # type: ignore[method-assign]
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq_len + 1), generator=gen).to(device)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32

    def step() -> None:
        with torch.autocast(device, dtype=dtype, enabled=device == "cuda"):
            logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(
            logits.float().flatten(0, 1), tokens[:, 1:].flatten()
        )
        loss.backward()
        opt.step()
        opt.zero_grad()
        with record_function("L:bias_update"):
            update_expert_bias([model])

    for _ in range(2):  # warm-up: allocator, optimizer state, the grouped-GEMM probe
        step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        step()
        if device == "cuda":
            torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    secs = split(prof.events(), device)
    total = sum(secs.values())
    share = {k: round(100 * v / total, 1) for k, v in sorted(secs.items(), key=lambda kv: -kv[1])}
    print(json.dumps({
        "model": f"{a.family} {a.flavor}", "n_layers": args.n_layers, "tokens": a.batch * a.seq_len,
        "device": device, "float8_experts": a.float8_experts, "torch": torch.__version__,
        "threads": torch.get_num_threads(), "profiled_s": round(total, 4),
        "wall_s_with_profiler": round(wall, 4), "share_pct": share,
        "seconds": {k: round(v, 6) for k, v in secs.items()},
    }))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
