"""Step time of a layout, per device (docs/planning.md, "Parallelism planner")::

    compute   = FLOPs of the device's tokens (plus activation recompute) / (peak * mfu)
    cp_attention_skew = the attention compute times (max / mean - 1) of the per-cp-rank
                attention pairs, with packed documents (block_causal, ``--document_lengths``):
                the load balancer's cost (``cp_attention_imbalance``); the slowest rank sets
                the step
    bubble    = compute * (pp - 1) / (stages per rank * microbatches)     (pipeline idle time)
    tp, cp    = activation all-gathers / reduce-scatters, not overlapped (intra- or inter-node),
                each also paying ``Hardware.sync_us`` (the ranks' skew between computations)
    fsdp      = parameter all-gathers and gradient reduce-scatters; hidden behind up to
                ``fsdp_overlap`` of the compute, the rest exposed
    pp_p2p    = stage-boundary activations and gradients
    all_to_all, moe_tp = expert parallel's token exchange and TP-replicated expert compute
                (MoE models, ``planner/moe_plan.py``)
    lora      = adapters on a frozen base (``planner/lora_memory.py``): the base's backward skips
                the weight-gradient matmuls, FSDP reduces and the optimizer steps the adapters
                only; ``nf4_dequant``, QLoRA's dequantization per matmul
    vision_replicated = a vision tower's work repeated on every cp and tp rank (each encodes
                every image of its group's batch); under PP the tower's FLOPs weigh on the
                first stage's load (``_tower_per_token``)
    step      = compute + cp_attention_skew + vision_replicated + bubble + tp + cp
                + exposed fsdp + pp_p2p + all_to_all + moe_tp
                + nf4_dequant

A collective moving ``S`` bytes over ``n`` ranks costs ``S * (n - 1) / n / bandwidth`` plus
``(n - 1) * latency``; the bandwidth is the intra-node one when the group fits in a node (the
mesh is ordered pp, dp_replicate, dp_shard, cp, tp from outermost to innermost, so tp is
placed first inside a node, then cp, then dp_shard), the inter-node one otherwise.
"""

from __future__ import annotations

import functools

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.context_parallel.layout import window_imbalance
from torchtitan.models import MODELS
from torchtitan.models.common.vision.flops import tower_training_flops
from torchtitan.models.spec import DecoderShape as ModelArgs
from torchtitan.planner.estimator import block_params, param_dtype_bytes
from torchtitan.planner.layout import Hardware, Layout
from torchtitan.planner.levers import chunked_loss_seconds, offload_seconds
from torchtitan.planner.lora_memory import lora_shares, training_flops_per_token
from torchtitan.planner.moe_plan import (
    active_block_params,
    expert_params,
    moe_op_recompute_fraction,
    moe_step_terms,
)
from torchtitan.preflight.validate import pipeline_stages

__all__ = ["cp_attention_imbalance", "step_time"]


def _collective_s(nbytes: float, n: int, hw: Hardware, spans_nodes: bool) -> float:
    if n <= 1:
        return 0.0
    bw = (hw.inter_node_gbps if spans_nodes else hw.intra_node_gbps) * 1e9
    latency = (hw.inter_latency_us if spans_nodes else hw.intra_latency_us) * 1e-6
    return nbytes * (n - 1) / n / bw + (n - 1) * latency


def _latencies_s(count: float, n: int, hw: Hardware, spans_nodes: bool) -> float:
    """The latency of ``count`` more collectives over ``n`` ranks (their bytes counted apart)."""
    if n <= 1:
        return 0.0
    latency = (hw.inter_latency_us if spans_nodes else hw.intra_latency_us) * 1e-6
    return count * (n - 1) * latency


def _gemm_efficiency(width: float, hw: Hardware) -> float:
    """Relative matmul efficiency of a sharded width: ``width / (width + gemm_half_width)``."""
    return width / (width + hw.gemm_half_width)


def _recompute_fraction(a: ModelArgs, ac_mode: str, ac_option: str) -> float:
    """Extra block forward FLOPs, as a fraction of one block forward."""
    if ac_mode == "full":
        return 1.0
    if ac_mode == "selective" and ac_option == "op":
        moe = moe_op_recompute_fraction(a)
        if moe is not None:
            return moe
        # wk, wo and w3 (every second matmul) are recomputed.
        d, kv = a.dim, a.kv_heads * a.head_dim
        recomputed = d * kv + d * d + d * a.hidden_dim
        return recomputed / (2 * d * d + 2 * d * kv + 3 * d * a.hidden_dim)
    if ac_mode == "selective":
        return 1.0 / int(ac_option)
    return 0.0


def cp_attention_imbalance(cfg: JobConfig, hw: Hardware, cp: int) -> float:
    """``max / mean`` attention work over the cp ranks (mean over packed windows): the load
    balancer's own cost (``distributed/context_parallel/layout.py: window_imbalance``) on
    ``hw.document_lengths`` under block_causal; 1.0 otherwise (causal head-tail is exact)."""
    if cp < 2 or not hw.document_lengths or cfg.model.attn_mask_type != "block_causal":
        return 1.0
    balancer = cfg.parallelism.context_parallel_load_balancer
    return _imbalance(hw.document_lengths, cfg.training.seq_len, cp, balancer)


@functools.lru_cache(maxsize=64)
def _imbalance(lengths: tuple[int, ...], seq: int, cp: int, balancer: str) -> float:
    return float(window_imbalance(lengths, seq, cp, balancer).mean())


def _tower_per_token(cfg: JobConfig, a: ModelArgs) -> float:
    """A vision tower's training FLOPs per token of the rows (one image of
    ``training.image_tokens_per_sample`` merged tokens per sample); 0 without one."""
    v = getattr(a, "vision", None)
    tokens = cfg.training.image_tokens_per_sample
    if v is None or tokens <= 0:
        return 0.0
    return tower_training_flops(v, tokens * v.spatial_merge_size**2) / cfg.training.seq_len


def step_time(
    cfg: JobConfig, a: ModelArgs, layout: Layout, hw: Hardware, world_size: int
) -> tuple[float, dict[str, float]]:
    seq = cfg.training.seq_len
    act = param_dtype_bytes(cfg, hw.device_type)
    g = hw.gpus_per_node
    tokens_device = layout.global_batch_size * seq / world_size
    all_blocks = a.n_layers * active_block_params(a, block_params(a))
    block_flops_fwd_token = 2 * all_blocks + 4 * a.n_layers * a.n_heads * a.head_dim * seq
    peak = hw.peak_tflops * 1e12 * hw.mfu
    # The model's matmuls, a frozen base's missing weight gradients included (planner/lora_memory.py)
    compute = tokens_device * training_flops_per_token(layout.apply(cfg), a) / peak
    lora = lora_shares(layout.apply(cfg), a)  # adapters: planner/lora_memory.py
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
    sync = hw.sync_us * 1e-6  # each blocking collective between computations (Hardware)
    tp = (
        layers_here
        * passes
        * 4
        * (_collective_s(tokens_group * a.dim * act, layout.tp, hw, tp_spans) + sync)
        if layout.tp > 1
        else 0.0
    )
    # CP: per layer and pass, all-gather K and V of the full sequence (backward: reduce-scatter).
    kv_width = a.kv_heads * a.head_dim
    cp_spans = layout.tp * layout.cp > g
    cp_bytes = 2 * tokens_group * layout.cp * kv_width / layout.tp * act
    cp = (
        layers_here * passes * (_collective_s(cp_bytes, layout.cp, hw, cp_spans) + sync)
        if layout.cp > 1
        else 0.0
    )
    # FSDP / HSDP / DDP: this rank's parameters (after TP and PP); routed experts apart (replicated
    # over TP, E / ep of them gathered over efsdp = dp_shard / ep, planner/moe_plan.py).
    experts = expert_params(a)
    params_rank = (MODELS[cfg.model.name].num_params(a) - experts) / layout.tp / layout.pp
    experts_rank = experts / layout.pp / layout.ep
    efsdp = layout.dp_shard * layout.cp // layout.ep
    n_shard = layout.dp_shard * layout.cp
    shard_spans = layout.tp * n_shard > g
    grad_bytes = 4 if cfg.training.mixed_precision_reduce == "float32" else 2
    if layout.pp > 1:
        gathers, reduces = 1, 1  # gathered once per step, gradients reduced at its end
    else:
        gathers, reduces = 2 * layout.accumulation, layout.accumulation
    gather_bytes = params_rank * act if lora is None else lora.gather_bytes(params_rank, act)
    grad_params = params_rank if lora is None else lora.adapters_of(params_rank)
    experts_grad = experts_rank if lora is None else 0.0  # a frozen base reduces no gradient
    gather_s = reduce_s = 0.0
    # FSDP wraps each block and the root: one collective per unit and pass, each with its latency
    # (what makes FSDP slower than DDP where latency is high: gloo on busy CPU cores).
    units = max(1, round(layers_here)) + 1
    extra = _latencies_s(units - 1, n_shard, hw, shard_spans) + units * sync
    if n_shard > 1:
        gather_s = gathers * (_collective_s(gather_bytes, n_shard, hw, shard_spans) + extra)
        reduce_s = reduces * (
            hw.reduce_scatter_factor
            * _collective_s(grad_params * grad_bytes, n_shard, hw, shard_spans)
            + extra
        )
    if experts and efsdp > 1:
        gather_s += gathers * _collective_s(experts_rank * act, efsdp, hw, shard_spans)
        reduce_s += reduces * _collective_s(experts_grad * grad_bytes, efsdp, hw, shard_spans)
    if layout.dp_replicate > 1:  # all-reduce of the gradient shards across replicas
        # the replicas are outside tp x shard in the mesh: inside one node while all of it fits
        rep_spans = layout.tp * n_shard * layout.dp_replicate > g
        reduce_s += 2 * _collective_s(
            (grad_params / n_shard + experts_grad / efsdp) * grad_bytes,
            layout.dp_replicate,
            hw,
            rep_spans,
        )
        # per FSDP unit under HSDP; pure DDP (replicate of the whole model) is one all-reduce
        if n_shard > 1:
            reduce_s += 2 * _latencies_s(units - 1, layout.dp_replicate, hw, rep_spans)
    fsdp_total = gather_s + reduce_s
    # CP with packed documents: the slowest rank's attention sets the step (cp_attention_skew).
    attention = tokens_device * 12 * a.n_layers * a.n_heads * a.head_dim * seq / peak
    cp_skew = attention * (cp_attention_imbalance(cfg, hw, layout.cp) - 1.0)
    # A vision tower: cp and tp ranks each encode every image, cp x tp times their even share.
    tower_token = _tower_per_token(cfg, a)
    vision = tokens_device * tower_token * (layout.cp * layout.tp - 1) / peak
    work = balanced = compute + recompute + tp_gemm + cp_skew + vision
    fsdp = max(0.0, fsdp_total - hw.fsdp_overlap * work)
    bubble = 0.0
    pp_p2p = 0.0
    tower_load = 0.0
    if layout.pp > 1:
        mb = layout.microbatches
        plan = pipeline_stages(layout.apply(cfg))
        assert plan is not None
        v = plan.stages_per_rank
        # The pipeline runs at the pace of its busiest rank; the head (output projection and
        # loss, the last unit) costs about vocab * dim / block params blocks of work; a
        # vision tower rides in the first unit: its FLOPs (cp x tp replicated) in blocks'.
        head = a.vocab_size * a.dim / active_block_params(a, block_params(a))
        model_plan = MODELS[cfg.model.name].parallel_plan(a)
        first_unit, head_unit = model_plan.unit_names[0], model_plan.unit_names[-1]
        block_train = 3 * block_flops_fwd_token / a.n_layers / layout.tp / layout.cp
        tower_load = tower_token / block_train
        unit_load = {first_unit: tower_load}
        unit_load[head_unit] = head + (unit_load[first_unit] if head_unit == first_unit else 0)
        load = [
            sum(
                1.0 if u.startswith(f"{model_plan.blocks}.") else unit_load.get(u, 0.0)
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
        # a send and a receive per microbatch and local stage, forward and backward; the
        # slowest neighbour pair sets the pace: across nodes once the whole mesh spans them
        inner = layout.tp * n_shard * layout.dp_replicate
        bw, lat = (
            (hw.inter_node_gbps, hw.inter_latency_us)
            if inner * layout.pp > g
            else (hw.intra_node_gbps, hw.intra_latency_us)
        )
        pp_p2p = 2 * mb * v * (boundary / (bw * 1e9) + lat * 1e-6)
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
    terms["imbalance"] = work - balanced  # exactly 0 without PP (no rounding residue)
    terms["vision_replicated"], terms["tower_load"] = vision, tower_load
    terms["cp_attention_skew"] = cp_skew
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
    # The optimizer step over this rank's parameters (sharded by FSDP, split by TP and PP);
    # offload moves it to the host (offload_seconds).
    terms["optimizer"] = 0.0
    if "cpu_offload" not in layout.levers:
        state = 4 + 4 + (4 if "bf16_moments" in layout.levers else 8)
        shard = grad_params / n_shard + experts_grad / max(1, efsdp)
        terms["optimizer"] = shard * state / (hw.optimizer_gbps * 1e9)
    frac = _recompute_fraction(a, layout.ac_mode, layout.ac_option)
    terms.update(moe_step_terms(a, layout, hw, seq, act, peak, frac))
    total = work + bubble + tp + cp + fsdp + pp_p2p + terms["all_to_all"] + terms["moe_tp"]
    total += terms["chunked_loss"] + terms["offload_copies"] + terms["offload_optimizer"]
    total += terms["optimizer"]
    # QLoRA: every frozen matmul dequantizes its NF4 weight per pass and microbatch.
    micro = layout.microbatches if layout.pp > 1 else layout.accumulation
    terms["nf4_dequant"] = 0.0
    if lora is not None:
        terms["nf4_dequant"] = lora.dequant_s(params_rank, micro * passes, hw.optimizer_gbps)
    total += terms["nf4_dequant"]
    return total, terms
