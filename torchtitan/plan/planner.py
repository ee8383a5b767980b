"""Parallelism planner: enumerate layouts, drop those that do not fit, rank the rest by speed.

A layout is (dp_replicate, dp_shard, tp, pp, cp, activation checkpointing, gradient-accumulation
steps, pipeline schedule and microbatches) on ``world_size`` devices of ``gpus_per_node`` each.
The global batch (sequences per optimizer step) is the config's and stays fixed, so every layout
trains the same thing; the local batch follows from the data-parallel degree.

Step time of a layout (per device, seconds)::

    compute   = FLOPs of the device's tokens (plus activation recompute) / (peak * mfu)
    bubble    = compute * (pp - 1) / (stages per rank * microbatches)     (pipeline idle time)
    tp, cp    = activation all-gathers / reduce-scatters, not overlapped (intra- or inter-node)
    fsdp      = parameter all-gathers and gradient reduce-scatters; hidden behind up to
                ``fsdp_overlap`` of the compute, the rest exposed
    pp_p2p    = stage-boundary activations and gradients
    step      = compute + bubble + tp + cp + exposed fsdp + pp_p2p

A collective moving ``S`` bytes over ``n`` ranks costs ``S * (n - 1) / n / bandwidth`` plus
``(n - 1) * latency``; the bandwidth is the intra-node one when the group fits in a node (the
mesh is ordered pp, dp_replicate, dp_shard, cp, tp from outermost to innermost, so tp is
placed first inside a node, then cp, then dp_shard), the inter-node one otherwise.

The model is coarse (no kernel-efficiency curve, no compute/communication contention), which is
why the output lists the terms: read them as "why", not as a promise of tokens/s.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims, divisors
from torchtitan.distributed.tensor_parallel import tp_problem
from torchtitan.models import MODELS
from torchtitan.models.spec import DecoderShape as ModelArgs
from torchtitan.plan.estimator import (
    GIB,
    MemoryEstimate,
    block_params,
    estimate_memory,
    format_bytes,
    param_dtype_bytes,
)
from torchtitan.plan.levers import (
    LEVER_SETS,
    NAMES,
    apply_levers,
    chunked_loss_seconds,
    lever_overrides,
    offload_seconds,
)
from torchtitan.preflight.validate import pipeline_plan

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


@dataclass(frozen=True)
class Hardware:
    """The devices and the network between them."""

    memory_gib: float
    """Usable memory per device."""
    peak_tflops: float = 989.4
    """Dense peak of one device in the compute dtype (default: H100 SXM bf16, datasheet)."""
    gpus_per_node: int = 8
    mfu: float = 0.5
    """Fraction of the peak the model's matmuls reach (model FLOPs utilization ceiling)."""
    intra_node_gbps: float = 450.0
    """Per-device bus bandwidth of collectives inside a node, GB/s (NVLink 4: ~450)."""
    inter_node_gbps: float = 25.0
    """Per-device bus bandwidth that collectives reach across nodes, GB/s. One 400 Gb/s NIC
    per GPU peaks at 50 GB/s; rings over tens of nodes on a shared fabric reach about half."""
    intra_latency_us: float = 10.0
    inter_latency_us: float = 30.0
    fsdp_overlap: float = 0.7
    """Fraction of the compute time FSDP's collectives can hide behind."""
    gemm_half_width: float = 128.0
    """Matmul efficiency is modelled as n / (n + this) in the narrowest dimension n a device
    multiplies; TP divides n, so TP 8 on an 8192-wide model costs about 10% more compute time."""
    prefer_simpler_within: float = 0.05
    """Among layouts predicted within this fraction of the fastest, rank first the one with
    the fewest parallel dimensions (then the smallest TP): the model's error is of that order,
    and every extra dimension is more to tune and debug."""
    headroom: float = 0.1
    """Fraction of the memory kept free: a layout fits when its estimate is at most
    (1 - headroom) x memory_gib (the estimator is calibrated to about 10%)."""
    host_device_gbps: float = 25.0
    """Host-device bandwidth one device sees, GB/s, for CPU offload's copies (plan/levers.py)."""
    host_memory_gbps: float = 10.0
    """Host memory bandwidth one device's CPU optimizer step gets, GB/s (plan/levers.py)."""


@dataclass(frozen=True)
class Layout:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    cp: int
    ac_mode: str
    ac_option: str
    local_batch_size: int
    global_batch_size: int
    schedule: str = "1F1B"
    microbatches: int = -1
    levers: tuple[str, ...] = ()
    """Memory levers switched on (``plan/levers.py``)."""

    @property
    def accumulation(self) -> int:
        return self.global_batch_size // (self.local_batch_size * self.dp_replicate * self.dp_shard)

    def describe(self) -> str:
        parts = []
        if self.dp_replicate > 1:
            parts.append(f"dp_replicate {self.dp_replicate}")
        if self.dp_shard > 1:
            parts.append(f"FSDP {self.dp_shard}")
        for name, d in (("TP", self.tp), ("CP", self.cp), ("PP", self.pp)):
            if d > 1:
                parts.append(f"{name} {d}")
        text = " x ".join(parts) or "single device"
        if self.pp > 1:
            text += f" ({self.schedule}, {self.microbatches} microbatches)"
        ac = self.ac_mode if self.ac_mode != "selective" else f"selective {self.ac_option}"
        levers = ", ".join(NAMES[n] for n in self.levers)
        return (
            f"{text}; AC {ac}; local batch {self.local_batch_size}"
            + (f" x {self.accumulation} accumulation steps" if self.accumulation > 1 else "")
            + (f"; {levers}" if levers else "")
        )

    def overrides(self) -> list[str]:
        """Command-line overrides that select this layout."""
        args = [
            f"--parallelism.data_parallel_replicate_degree {self.dp_replicate}",
            f"--parallelism.data_parallel_shard_degree {self.dp_shard}",
            f"--parallelism.tensor_parallel_degree {self.tp}",
            f"--parallelism.context_parallel_degree {self.cp}",
            f"--parallelism.pipeline_parallel_degree {self.pp}",
        ]
        if self.pp > 1:
            args += [
                f"--parallelism.pipeline_parallel_schedule {self.schedule}",
                f"--parallelism.pipeline_parallel_microbatches {self.microbatches}",
            ]
        args += [
            f"--training.local_batch_size {self.local_batch_size}",
            f"--training.global_batch_size {self.global_batch_size}",
            f"--activation_checkpoint.mode {self.ac_mode}",
        ]
        if self.ac_mode == "selective":
            args.append(f"--activation_checkpoint.selective_ac_option {self.ac_option}")
        return args + lever_overrides(self.levers)

    def apply(self, cfg: JobConfig) -> JobConfig:
        out = apply_levers(cfg, self.levers)
        p, t, ac = out.parallelism, out.training, out.activation_checkpoint
        p.data_parallel_replicate_degree, p.data_parallel_shard_degree = (
            self.dp_replicate,
            self.dp_shard,
        )
        p.tensor_parallel_degree, p.context_parallel_degree = self.tp, self.cp
        p.pipeline_parallel_degree = self.pp
        p.pipeline_parallel_schedule, p.pipeline_parallel_microbatches = (
            self.schedule,
            self.microbatches,
        )
        p.pipeline_parallel_microbatch_size = -1
        p.pipeline_parallel_split_points, p.pipeline_parallel_layers_per_stage = [], -1
        t.local_batch_size, t.global_batch_size = self.local_batch_size, self.global_batch_size
        ac.mode, ac.selective_ac_option = self.ac_mode, self.ac_option  # type: ignore[assignment]
        return out


@dataclass
class PlanResult:
    layout: Layout
    memory: MemoryEstimate
    step_time_s: float
    tokens_per_s_per_device: float
    terms: dict[str, float]
    """Seconds per step: compute, recompute, bubble, tp, cp, fsdp (exposed), fsdp_total, pp_p2p."""
    reasons: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------- cost model
def _collective_s(nbytes: float, n: int, hw: Hardware, spans_nodes: bool) -> float:
    if n <= 1:
        return 0.0
    bw = (hw.inter_node_gbps if spans_nodes else hw.intra_node_gbps) * 1e9
    latency = (hw.inter_latency_us if spans_nodes else hw.intra_latency_us) * 1e-6
    return nbytes * (n - 1) / n / bw + (n - 1) * latency


def _gemm_efficiency(width: float, hw: Hardware) -> float:
    """Relative matmul efficiency of a sharded width: ``width / (width + gemm_half_width)``."""
    return width / (width + hw.gemm_half_width)


def _recompute_fraction(a: ModelArgs, ac_mode: str, ac_option: str) -> float:
    """Extra block forward FLOPs, as a fraction of one block forward."""
    if ac_mode == "full":
        return 1.0
    if ac_mode == "selective" and ac_option == "op":
        # wk, wo and w3 (every second matmul) are recomputed.
        d, kv = a.dim, a.kv_heads * a.head_dim
        recomputed = d * kv + d * d + d * a.hidden_dim
        return recomputed / (2 * d * d + 2 * d * kv + 3 * d * a.hidden_dim)
    if ac_mode == "selective":
        return 1.0 / int(ac_option)
    return 0.0


def step_time(
    cfg: JobConfig, a: ModelArgs, layout: Layout, hw: Hardware, world_size: int
) -> tuple[float, dict[str, float]]:
    seq = cfg.training.seq_len
    act = param_dtype_bytes(cfg, "cuda")
    g = hw.gpus_per_node
    tokens_device = layout.global_batch_size * seq / world_size
    all_blocks = a.n_layers * block_params(a)
    block_flops_fwd_token = 2 * all_blocks + 4 * a.n_layers * a.n_heads * a.head_dim * seq
    peak = hw.peak_tflops * 1e12 * hw.mfu
    compute = tokens_device * MODELS[cfg.model.name].flops_per_token(a, seq) / peak
    recompute = (
        tokens_device
        * block_flops_fwd_token
        * _recompute_fraction(a, layout.ac_mode, layout.ac_option)
        / peak
    )
    # TP narrows every block matmul; narrow GEMMs run further from the peak.
    narrow = min(a.dim, a.hidden_dim)
    tp_eff = _gemm_efficiency(narrow / layout.tp, hw) / _gemm_efficiency(narrow, hw)
    tp_gemm = (compute + recompute) * (1 / tp_eff - 1)
    passes = 2 + _recompute_fraction(a, layout.ac_mode, layout.ac_option)  # fwd, bwd, recompute
    layers_here = a.n_layers / layout.pp
    dp = layout.dp_replicate * layout.dp_shard
    tokens_group = layout.global_batch_size * seq / dp / layout.cp  # one TP group's tokens
    # TP: per layer and pass, two all-gathers and two reduce-scatters of [tokens, d].
    tp_spans = layout.tp > g
    tp = (
        layers_here
        * passes
        * 4
        * _collective_s(tokens_group * a.dim * act, layout.tp, hw, tp_spans)
        if layout.tp > 1
        else 0.0
    )
    # CP: per layer and pass, all-gather K and V of the full sequence (backward: reduce-scatter).
    kv_width = a.kv_heads * a.head_dim
    cp_spans = layout.tp * layout.cp > g
    cp = (
        layers_here
        * passes
        * _collective_s(
            2 * tokens_group * layout.cp * kv_width / layout.tp * act, layout.cp, hw, cp_spans
        )
        if layout.cp > 1
        else 0.0
    )
    # FSDP / HSDP / DDP: this rank's parameters (after TP and PP).
    params_rank = MODELS[cfg.model.name].num_params(a) / layout.tp / layout.pp
    n_shard = layout.dp_shard * layout.cp
    shard_spans = layout.tp * n_shard > g
    grad_bytes = 4 if cfg.training.mixed_precision_reduce == "float32" else 2
    if layout.pp > 1:
        gathers, reduces = 1, 1  # gathered once per step, gradients reduced at its end
    else:
        gathers, reduces = 2 * layout.accumulation, layout.accumulation
    gather_s = reduce_s = 0.0
    if n_shard > 1:
        gather_s = gathers * _collective_s(params_rank * act, n_shard, hw, shard_spans)
        reduce_s = reduces * _collective_s(params_rank * grad_bytes, n_shard, hw, shard_spans)
    if layout.dp_replicate > 1:  # all-reduce of the gradient shards across replicas
        reduce_s += 2 * _collective_s(
            params_rank / n_shard * grad_bytes, layout.dp_replicate, hw, True
        )
    fsdp_total = gather_s + reduce_s
    work = compute + recompute + tp_gemm
    fsdp = max(0.0, fsdp_total - hw.fsdp_overlap * work)
    bubble = 0.0
    pp_p2p = 0.0
    if layout.pp > 1:
        mb = layout.microbatches
        plan = pipeline_plan(layout.apply(cfg))
        assert plan is not None
        v = plan.stages_per_rank
        # The pipeline runs at the pace of its busiest rank; the head (output projection and
        # loss, the last unit) costs about vocab * dim / block params blocks of work.
        head = a.vocab_size * a.dim / block_params(a)
        model_plan = MODELS[cfg.model.name].parallel_plan(a)
        head_unit = model_plan.unit_names[-1]
        load = [
            sum(
                1.0 if u.startswith(f"{model_plan.blocks}.") else (head if u == head_unit else 0.0)
                for sid in plan.stage_ids(r)
                for u in plan.stage_units[sid]
            )
            for r in range(layout.pp)
        ]
        imbalance = max(load) / (sum(load) / layout.pp)
        work *= imbalance
        bubble = work * (layout.pp - 1) / (v * mb)
        # torch's schedules reduce FSDP gradients once, after the last microbatch's backward
        # (REDUCE_GRAD): nothing is left to hide behind. The gathers overlap the first
        # microbatch's forward and the pipeline fill.
        fsdp = reduce_s + max(0.0, gather_s - hw.fsdp_overlap * (work / mb + bubble))
        boundary = tokens_group / mb * a.dim / layout.tp * act
        pp_p2p = 2 * mb * v * boundary / (hw.inter_node_gbps * 1e9)
    terms = {
        "compute": compute,
        "recompute": recompute,
        "bubble": bubble,
        "tp": tp,
        "cp": cp,
        "fsdp": fsdp,
        "fsdp_total": fsdp_total,
        "pp_p2p": pp_p2p,
        "tp_gemm": tp_gemm,
    }
    terms["imbalance"] = work - compute - recompute - tp_gemm
    terms["chunked_loss"] = terms["offload_copies"] = terms["offload_optimizer"] = 0.0
    if "chunked_loss" in layout.levers:
        vocab_local = a.vocab_size / layout.tp
        terms["chunked_loss"] = chunked_loss_seconds(tokens_device, a.dim, vocab_local, peak)
    if "cpu_offload" in layout.levers:
        moments = 4 if "bf16_moments" in layout.levers else 8
        copies, optimizer = offload_seconds(
            params_rank / n_shard, gathers, moments, hw.host_device_gbps, hw.host_memory_gbps
        )
        terms["offload_copies"], terms["offload_optimizer"] = copies, optimizer
    total = work + bubble + tp + cp + fsdp + pp_p2p
    total += terms["chunked_loss"] + terms["offload_copies"] + terms["offload_optimizer"]
    return total, terms


# ---------------------------------------------------------------------- enumeration
def global_batch_of(cfg: JobConfig, world_size: int) -> int:
    """Sequences per optimizer step the config asks for on ``world_size`` ranks."""
    t = cfg.training
    dims = ParallelDims.from_config(cfg.parallelism, world_size)
    return dims.batch_plan(t.local_batch_size, t.global_batch_size).global_batch_size


def _tp_ok(cfg: JobConfig, a: ModelArgs, tp: int, seq: int) -> bool:
    divisible = MODELS[cfg.model.name].parallel_plan(a).tensor_parallel.divisible
    return tp_problem(divisible, tp, seq) is None


def enumerate_layouts(cfg: JobConfig, a: ModelArgs, world_size: int, hw: Hardware) -> list[Layout]:
    """Every layout the config's rules accept (memory not checked yet)."""
    seq = cfg.training.seq_len
    gbs = global_batch_of(cfg, world_size)
    g = min(hw.gpus_per_node, world_size)
    out: list[Layout] = []
    for tp in (d for d in divisors(g) if _tp_ok(cfg, a, d, seq)):
        for cp in (c for c in CP_CHOICES if c == 1 or (seq % (2 * c) == 0 and seq // c >= 8192)):
            if (world_size // tp) % cp or world_size % (tp * cp):
                continue
            for pp in divisors(world_size // (tp * cp)):
                if pp > 1 and (pp > a.n_layers // 2 or a.tie_word_embeddings):
                    continue
                dp = world_size // (tp * cp * pp)
                if gbs % dp:
                    continue
                per_dp = gbs // dp
                in_node = max(1, g // (tp * cp))
                replicas = {1, dp} | ({dp // in_node} if dp % in_node == 0 else set())
                for r in sorted(replicas):
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
            pipeline_plan(trial)
        except ConfigError:
            continue
        choices.append((schedule, mb))
    return choices


def plan(
    cfg: JobConfig, a: ModelArgs, world_size: int, hw: Hardware
) -> tuple[list[PlanResult], int, int]:
    """Fitting layouts, fastest first; plus how many were enumerated and how many did not fit."""
    layouts = enumerate_layouts(cfg, a, world_size, hw)
    # No lever first; when nothing fits, the lever sets of plan/levers.py, cheapest first.
    for levers in LEVER_SETS:
        candidates = [
            dataclasses.replace(lay, levers=levers)
            for lay in layouts
            # offload needs FSDP, on a 1-rank mesh too; preflight refuses it with pure DDP
            if "cpu_offload" not in levers or lay.dp_shard * lay.cp > 1 or lay.dp_replicate == 1
        ]
        results, too_big = _fitting(cfg, a, world_size, hw, candidates)
        if results:
            break
    if not results:
        results, too_big = [], len(layouts)
    for r in results:
        r.reasons = _reasons(r, hw, world_size)
    if results and results[0].step_time_s > min(r.step_time_s for r in results):
        fastest = min(results, key=lambda r: r.step_time_s)
        results[0].reasons.append(
            f"simplest layout within {hw.prefer_simpler_within:.0%} of the fastest "
            f"({fastest.layout.describe()}: {fastest.tokens_per_s_per_device:,.0f} tokens/s)"
        )
    return results, len(layouts), too_big


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
    if t.get("imbalance", 0) > 0:
        out.append(f"pipeline stage imbalance {t['imbalance']:.2f} s (the head's stage is busier)")
    if t["bubble"] > 0:
        out.append(f"pipeline bubble {t['bubble']:.2f} s ({pct(t['bubble'])})")
    if lay.levers:
        names = ", ".join(NAMES[n] for n in lay.levers)
        out.append(f"needs memory levers to fit (docs/memory.md): {names}")
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
