"""Parallelism planner: enumerate layouts, drop those that do not fit, rank the rest by speed.

A layout (``planner/layout.py``) is (dp_replicate, dp_shard, tp, pp, cp, expert parallel,
activation checkpointing, gradient-accumulation steps, pipeline schedule and microbatches) on
``world_size`` devices of ``gpus_per_node`` each. The global batch (sequences per optimizer step)
is the config's and stays fixed, so every layout trains the same thing; the local batch follows
from the data-parallel degree. Each layout that fits (``planner/estimator.py``) gets a step time
(``planner/cost_model.py``); the fastest come first, the simplest among those within
``prefer_simpler_within`` of the fastest first of all.

The model is coarse (no kernel-efficiency curve, no compute/communication contention), which is
why the output lists the terms: read them as "why", not as a promise of tokens/s.
"""

from __future__ import annotations

import copy
import dataclasses

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims, divisors
from torchtitan.distributed.tensor_parallel import tp_problem
from torchtitan.models import MODELS
from torchtitan.models.spec import DecoderShape as ModelArgs
from torchtitan.planner.cost_model import step_time
from torchtitan.planner.estimator import GIB, estimate_memory, format_bytes
from torchtitan.planner.layout import Hardware, Layout, PlanResult
from torchtitan.planner.levers import LEVER_SETS, NAMES
from torchtitan.planner.moe_plan import ep_choices
from torchtitan.preflight.validate import pipeline_stages

__all__ = [
    "AC_CHOICES",
    "CP_CHOICES",
    "Hardware",
    "Layout",
    "PlanResult",
    "enumerate_layouts",
    "global_batch_of",
    "plan",
    "step_time",
    "summary",
]

CP_CHOICES = (1, 2, 4, 8, 16)
"""Context parallel degrees tried, and only while each rank keeps at least 8192 tokens of the
sequence: below that the K/V exchange is not hidden behind the attention it feeds (CP is for
long sequences)."""
AC_CHOICES: tuple[tuple[str, str], ...] = (
    ("none", "2"),
    ("selective", "op"),
    ("selective", "2"),
    ("full", "2"),
)


# ---------------------------------------------------------------------- enumeration
def global_batch_of(cfg: JobConfig, world_size: int) -> int:
    """Sequences per optimizer step the config asks for on ``world_size`` ranks."""
    t = cfg.training
    dims = ParallelDims.from_config(cfg.parallelism, world_size)
    return dims.batch_sizes(t.local_batch_size, t.global_batch_size).global_batch_size


def _tp_ok(cfg: JobConfig, a: ModelArgs, tp: int, seq: int) -> bool:
    divisible = MODELS[cfg.model.name].parallel_plan(a).tensor_parallel.divisible
    return tp_problem(divisible, tp, seq) is None


def _refused(cfg: JobConfig, a: ModelArgs) -> set[str]:
    """The parallelisms the model's plan refuses (``ModelParallelPlan.refusals``; CP also when
    the plan has no context-parallel form), as the preflight refuses them."""
    model_plan = MODELS[cfg.model.name].parallel_plan(a)
    refused = set(model_plan.refusals)
    if model_plan.context_parallel is None:
        refused.add("context_parallel")
    return refused


def enumerate_layouts(cfg: JobConfig, a: ModelArgs, world_size: int, hw: Hardware) -> list[Layout]:
    """Every layout the config's rules accept (memory not checked yet)."""
    seq = cfg.training.seq_len
    gbs = global_batch_of(cfg, world_size)
    g = min(hw.gpus_per_node, world_size)
    out: list[Layout] = []
    refused = _refused(cfg, a)  # what the model's plan refuses is never offered
    for tp in (d for d in divisors(g) if _tp_ok(cfg, a, d, seq)):
        if tp > 1 and "tensor_parallel" in refused:
            continue
        for cp in (c for c in CP_CHOICES if c == 1 or (seq % (2 * c) == 0 and seq // c >= 8192)):
            if (world_size // tp) % cp or world_size % (tp * cp):
                continue
            if cp > 1 and "context_parallel" in refused:
                continue
            for pp in divisors(world_size // (tp * cp)):
                if pp > 1 and "pipeline_parallel" in refused:
                    continue
                if pp > 1 and (pp > a.n_layers // 2 or a.tie_word_embeddings):
                    continue
                dp = world_size // (tp * cp * pp)
                if gbs % dp:
                    continue
                per_dp = gbs // dp
                in_node = max(1, g // (tp * cp))
                replicas = {1, dp} | ({dp // in_node} if dp % in_node == 0 else set())
                splits = [
                    (rep, ep)
                    for rep in sorted(replicas)
                    for ep in ep_choices(cfg, world_size, rep, dp // rep, cp, tp, pp)
                ]
                for r, ep in splits:
                    for accum in divisors(per_dp):
                        local = per_dp // accum
                        for mode, option in AC_CHOICES:
                            for schedule, mb in _pp_choices(cfg, a, pp, local):
                                out.append(
                                    Layout(
                                        dp_replicate=r,
                                        dp_shard=dp // r,
                                        tp=tp,
                                        pp=pp,
                                        cp=cp,
                                        ac_mode=mode,
                                        ac_option=option,
                                        local_batch_size=local,
                                        global_batch_size=gbs,
                                        schedule=schedule,
                                        microbatches=mb,
                                        ep=ep,
                                    )
                                )
    return out


def _pp_choices(cfg: JobConfig, a: ModelArgs, pp: int, local: int) -> list[tuple[str, int]]:
    if pp == 1:
        return [("1F1B", -1)]
    choices = []
    for schedule in ("1F1B", "Interleaved1F1B"):
        stages = pp * (2 if schedule != "1F1B" else 1)
        mb = local  # one sequence per microbatch: the smallest bubble and in-flight memory
        if mb < stages:
            continue
        trial = copy.deepcopy(cfg)
        trial.parallelism.pipeline_parallel_degree = pp
        trial.parallelism.pipeline_parallel_schedule = schedule
        trial.parallelism.pipeline_parallel_microbatches = mb
        trial.parallelism.pipeline_parallel_microbatch_size = -1
        trial.parallelism.pipeline_parallel_split_points = []
        trial.parallelism.pipeline_parallel_layers_per_stage = -1
        trial.training.local_batch_size = local
        try:
            pipeline_stages(trial)
        except ConfigError:
            continue
        choices.append((schedule, mb))
    return choices


def plan(
    cfg: JobConfig, a: ModelArgs, world_size: int, hw: Hardware
) -> tuple[list[PlanResult], int, int]:
    """Fitting layouts, fastest first; plus how many were enumerated and how many did not fit."""
    layouts = enumerate_layouts(cfg, a, world_size, hw)
    # No lever first; when nothing fits, the lever sets of planner/levers.py, cheapest first.
    full = [lv for lv in LEVER_SETS if "lora" not in lv]
    results, too_big = _first_fitting(cfg, a, world_size, hw, layouts, full)
    if not results or any("cpu_offload" in r.layout.levers for r in results[:1]):
        # Full fine-tuning does not fit, or only with CPU offload: adapters on a frozen base
        # (docs/lora.md) are proposed too, after any full fine-tuning layout.
        adapters = [lv for lv in LEVER_SETS if "lora" in lv]
        tuned, too_big_tuned = _first_fitting(cfg, a, world_size, hw, layouts, adapters)
        too_big = too_big if results else too_big_tuned
        results = results + tuned
    for r in results:
        r.reasons = _reasons(r, hw, world_size)
    # Among the layouts that train the same thing (full fine-tuning, or adapters).
    same = [r for r in results if _adapters(r) == _adapters(results[0])] if results else []
    if same and same[0].step_time_s > min(r.step_time_s for r in same):
        fastest = min(same, key=lambda r: r.step_time_s)
        results[0].reasons.append(
            f"simplest layout within {hw.prefer_simpler_within:.0%} of the fastest "
            f"({fastest.layout.describe()}: {fastest.tokens_per_s_per_device:,.0f} tokens/s)"
        )
    return results, len(layouts), too_big


def _adapters(r: PlanResult) -> bool:
    return "lora" in r.layout.levers


def summary(cfg: JobConfig, results: list[PlanResult]) -> list[str]:
    """The choice in plain words when the planner proposes adapters (docs/lora.md): full
    fine-tuning is what was asked for, so it keeps the first place where it fits at all (with
    CPU offload, say); the adapter layout trains something else, so it is named as such."""
    tuned = [(i, r) for i, r in enumerate(results, start=1) if _adapters(r)]
    if not tuned:
        return []
    full = [(i, r) for i, r in enumerate(results, start=1) if not _adapters(r)]
    if not full:
        lines = ["full fine-tuning: does not fit, even with the memory levers"]
    else:
        i, r = full[0]
        how = "only with CPU offload" if "cpu_offload" in r.layout.levers else "fits"
        lines = [f"full fine-tuning: {how}, {r.step_time_s:.1f} s/step (#{i})"]
    i, r = tuned[0]
    lo = r.layout.apply(cfg).lora
    kind = "QLoRA" if lo.quantize_base == "nf4" else "LoRA"
    lines.append(
        f"on device: {kind} r={lo.rank}, {r.memory.total / GIB:.1f} GiB, "
        f"{r.step_time_s:.1f} s/step (#{i}; trains adapters only, the base frozen)"
    )
    return lines


def _first_fitting(
    cfg: JobConfig,
    a: ModelArgs,
    world_size: int,
    hw: Hardware,
    layouts: list[Layout],
    lever_sets: list[tuple[str, ...]],
) -> tuple[list[PlanResult], int]:
    """The fitting layouts under the first lever set that has any; and how many did not fit."""
    for levers in lever_sets:
        candidates = [
            dataclasses.replace(lay, levers=levers)
            for lay in layouts
            # offload needs FSDP, on a 1-rank mesh too; preflight refuses it with pure DDP
            if "cpu_offload" not in levers or lay.dp_shard * lay.cp > 1 or lay.dp_replicate == 1
        ]
        if "qlora" in levers:  # an NF4 base: FSDP and PP only (preflight/validate_lora.py)
            candidates = [c for c in candidates if c.tp == c.cp == c.dp_replicate == 1]
        results, too_big = _fitting(cfg, a, world_size, hw, candidates)
        if results:
            return results, too_big
    return [], len(layouts)


def _fitting(
    cfg: JobConfig, a: ModelArgs, world_size: int, hw: Hardware, layouts: list[Layout]
) -> tuple[list[PlanResult], int]:
    """The layouts that fit, ranked; and how many did not fit."""
    results: list[PlanResult] = []
    too_big = 0
    fits_at: dict[tuple, int] = {}
    for layout in layouts:
        # More accumulation steps only cost time: skip once a smaller count fits.
        key = (
            layout.dp_replicate,
            layout.tp,
            layout.pp,
            layout.cp,
            layout.ac_mode,
            layout.ac_option,
            layout.schedule,
            layout.ep,
        )
        if key in fits_at and layout.accumulation > fits_at[key]:
            continue
        mem = estimate_memory(layout.apply(cfg), world_size, device_type="cuda", model_args=a)
        if mem.total > (1 - hw.headroom) * hw.memory_gib * GIB:
            too_big += 1
            continue
        fits_at[key] = min(fits_at.get(key, layout.accumulation), layout.accumulation)
        seconds, terms = step_time(cfg, a, layout, hw, world_size)
        tps = layout.global_batch_size * cfg.training.seq_len / seconds / world_size
        results.append(PlanResult(layout, mem, seconds, tps, terms))
    results.sort(key=lambda r: r.step_time_s)
    if results:
        limit = results[0].step_time_s * (1 + hw.prefer_simpler_within)
        near = [r for r in results if r.step_time_s <= limit]
        near.sort(key=lambda r: (_dimensions(r.layout), r.layout.tp, r.step_time_s))
        results = near + results[len(near) :]
    return results, too_big


def _dimensions(layout: Layout) -> int:
    """Parallel dimensions in use (FSDP or DDP counts as one, HSDP as two)."""
    dims = [layout.dp_shard > 1, layout.dp_replicate > 1, layout.tp > 1, layout.pp > 1]
    dims.append(layout.ep > 1)
    return sum(dims) + (layout.cp > 1) + (layout.accumulation > 1)


def _reasons(r: PlanResult, hw: Hardware, world_size: int) -> list[str]:
    t, lay, step = r.terms, r.layout, r.step_time_s
    out = [
        f"fits: {r.memory.total / GIB:.1f} of {hw.memory_gib:.0f} GiB (peak at {r.memory.phase})"
    ]

    def pct(x: float) -> str:
        return f"{100 * x / step:.0f}%"

    out.append(f"compute {t['compute']:.2f} s ({pct(t['compute'])} of the step)")
    if t["recompute"] > 0:
        out.append(f"activation recompute {t['recompute']:.2f} s ({pct(t['recompute'])})")
    if t["fsdp_total"] > 0:
        hidden = t["fsdp_total"] - t["fsdp"]
        where = "across nodes" if lay.tp * lay.dp_shard * lay.cp > hw.gpus_per_node else "in a node"
        out.append(
            f"FSDP/DP traffic {t['fsdp_total']:.2f} s {where}, {hidden:.2f} s hidden behind compute"
        )
    if t["tp"] > 0:
        out.append(f"TP activation collectives {t['tp']:.2f} s ({pct(t['tp'])}), inside a node")
        out.append(f"TP-narrowed matmuls {t['tp_gemm']:.2f} s slower ({pct(t['tp_gemm'])})")
    if t["cp"] > 0:
        out.append(f"CP K/V all-gathers {t['cp']:.2f} s ({pct(t['cp'])})")
    if t.get("cp_attention_skew", 0) > 0:
        skew = t["cp_attention_skew"]
        out.append(
            f"CP attention uneven over the ranks with these documents: the slowest rank "
            f"{skew:.2f} s more ({pct(skew)}; docs/context_parallel.md, load balancing)"
        )
    if t.get("all_to_all", 0) > 0:
        where = "across nodes" if lay.ep * lay.cp * lay.tp > hw.gpus_per_node else "in a node"
        out.append(
            f"expert parallel EP {lay.ep}: all-to-all {t['all_to_all']:.2f} s ({pct(t['all_to_all'])}) "
            f"{where}, {format_bytes(t['all_to_all_bytes'])} sent per rank and step"
        )
    if t.get("moe_tp", 0) > 0:
        out.append(f"MoE blocks run whole on each TP rank: {t['moe_tp']:.2f} s more expert compute")
    if t.get("vision_replicated", 0) > 0:
        rep = t["vision_replicated"]
        out.append(
            f"vision tower run whole on each of the {lay.cp * lay.tp} cp x tp ranks: "
            f"{rep:.2f} s more ({pct(rep)})"
        )
    if t.get("imbalance", 0) > 0:
        busier = "the head's or the vision tower's" if t.get("tower_load", 0) else "the head's"
        out.append(f"pipeline stage imbalance {t['imbalance']:.2f} s ({busier} stage is busier)")
    if t["bubble"] > 0:
        out.append(f"pipeline bubble {t['bubble']:.2f} s ({pct(t['bubble'])})")
    if lay.levers:
        names = ", ".join(NAMES[n] for n in lay.levers)
        out.append(f"needs memory levers to fit (docs/memory.md): {names}")
    if _adapters(r):
        out.append(
            "trains adapters only: no weight-gradient matmul for the frozen base, gradients "
            "reduced and optimizer state for the adapters alone"
        )
    if t.get("nf4_dequant", 0) > 0:
        out.append(f"NF4 dequantization {t['nf4_dequant']:.2f} s ({pct(t['nf4_dequant'])})")
    if t.get("chunked_loss", 0) > 0:
        out.append(f"chunked loss recompute {t['chunked_loss']:.2f} s ({pct(t['chunked_loss'])})")
    if t.get("offload_copies", 0) > 0:
        off = t["offload_copies"] + t["offload_optimizer"]
        out.append(
            f"CPU offload {off:.2f} s ({pct(off)}): copies {t['offload_copies']:.2f} s at "
            f"{hw.host_device_gbps:g} GB/s host-device, CPU optimizer step "
            f"{t['offload_optimizer']:.2f} s at {hw.host_memory_gbps:g} GB/s; "
            f"{format_bytes(r.memory.host)} in host memory"
        )
    return out
