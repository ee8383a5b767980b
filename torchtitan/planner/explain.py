"""Preflight explain (``--job.explain``): what a validated config will do, before any process group.

Printed by ``python -m torchtitan.train`` (then it exits 0 without training) and by
``python -m torchtitan.config`` (after the resolved TOML): the device mesh with every axis, the
batch and tokens each rank sees, gradient accumulation, pipeline stages and bubble, the memory
estimate with its notes (what the estimator assumed: Muon's gather buffers, CPU offload's host
memory, LoRA's frozen base, ...), and warnings about choices that usually cost speed or memory.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.parallel_dims import AXES, ParallelDims
from torchtitan.distributed.utils import device_type as detect_device_type
from torchtitan.fault_tolerance.explain import fault_tolerance_lines
from torchtitan.models import MODELS, model_title
from torchtitan.models.common.attention import resolve_attn_backend
from torchtitan.models.common.vision.flops import tower_training_flops
from torchtitan.planner.estimator import (
    GIB,
    MemoryEstimate,
    estimate_memory,
    format_bytes,
    in_flight_microbatches,
    model_args_for,
)
from torchtitan.planner.lora_memory import training_flops_per_token
from torchtitan.planner.moe_explain import moe_lines
from torchtitan.preflight.validate import pipeline_stages

_AXIS_TEXT = {
    "pp": "pipeline stages",
    "dp_replicate": "model replicas (DDP / HSDP replicate)",
    "dp_shard": "FSDP shards",
    "cp": "sequence shards (context parallel)",
    "tp": "tensor-parallel shards",
}


def pipeline_bubble(schedule: str, pp: int, stages_per_rank: int, microbatches: int) -> float:
    """Idle fraction of a pipeline step relative to its busy time: (pp - 1) / (v * m)."""
    return (pp - 1) / (stages_per_rank * microbatches)


def memory_levers_line(cfg: JobConfig, est: MemoryEstimate) -> str:
    """The memory levers in effect (docs/memory.md) and what the estimate counted for them."""
    t, o = cfg.training, cfg.optimizer
    on = []
    if t.loss_chunk_size > 0:
        on.append(f"chunked cross-entropy ({t.loss_chunk_size} tokens per chunk)")
    if o.moments_dtype == "bfloat16":
        on.append("bf16 Adam moments (4 bytes per parameter instead of 8)")
    if o.master_weights_dtype == "bfloat16":
        on.append("bf16 master weights and gradients (2 + 2 bytes per parameter)")
    if cfg.parallelism.fsdp_cpu_offload:
        on.append(f"FSDP CPU offload ({format_bytes(est.host)} in host memory)")
    return "memory levers: " + (
        "; ".join(on)
        if on
        else "none (python -m torchtitan.planner proposes them when a layout does not fit)"
    )


def estimate_notes(est: MemoryEstimate) -> list[str]:
    """The estimator's notes (docs/memory.md), one indented line each; none when it made none."""
    if not est.notes:
        return []
    return ["memory notes:", *(f"  - {n}" for n in est.notes)]


def explain(
    cfg: JobConfig,
    world_size: int,
    device_type: str | None = None,
    device_memory_bytes: int | None = None,
) -> str:
    """The preflight report of a validated config on ``world_size`` ranks."""
    if device_type is None:
        device_type = detect_device_type()
    t, p = cfg.training, cfg.parallelism
    dims = ParallelDims.from_config(p, world_size)
    args = model_args_for(cfg)
    plan = pipeline_stages(cfg)
    lines: list[str] = []
    warnings: list[str] = []
    add = lines.append

    add(
        f"== preflight: {model_title(cfg)} ("
        f"{MODELS[cfg.model.name].num_params(args) / 1e6:,.1f} M parameters, vocab {args.vocab_size})"
        f"; job {cfg.job.description!r}"
    )
    add(f"world size {world_size} on {device_type}; mesh (outermost to innermost):")
    stride = world_size
    for axis in AXES:
        degree = getattr(dims, axis)
        stride //= degree
        add(f"  {axis:>12} = {degree:<4} {_AXIS_TEXT[axis]}; neighbours are {stride} rank(s) apart")
    add(
        f"  FSDP shards parameters over dp_shard x cp = {dims.dp_shard * dims.cp} rank(s); "
        f"data loading over dp_replicate x dp_shard = {dims.dp_degree}"
    )

    batch = dims.batch_sizes(t.local_batch_size, t.global_batch_size)
    global_batch, accum = batch.global_batch_size, batch.grad_accum_steps
    seq_rank = t.seq_len // dims.cp
    add("batch:")
    add(
        f"  global {global_batch} sequences x {t.seq_len} tokens = "
        f"{global_batch * t.seq_len:,} tokens per optimizer step"
    )
    add(
        f"  per data-parallel rank: {t.local_batch_size} sequences per micro-step x "
        f"{accum} gradient-accumulation step(s)"
    )
    add(
        f"  per rank: {t.local_batch_size} x {seq_rank} tokens = {t.local_batch_size * seq_rank:,} "
        f"tokens per micro-step"
        + (f" (sequence split over cp={dims.cp})" if dims.cp > 1 else "")
        + (f"; the {dims.tp} TP ranks of a group share them" if dims.tp > 1 else "")
    )
    add(_attention_line(cfg, device_type, dims.cp))
    lines.extend(fault_tolerance_lines(cfg, dims, MODELS[cfg.model.name].num_params(args)))
    lines.extend(moe_lines(cfg, args, dims, device_type))  # MoE flavors only
    lines.extend(_vision_lines(cfg, args, training_flops_per_token(cfg, args)))  # VLMs only
    if plan is not None:
        mb = t.local_batch_size // plan.n_microbatches
        bubble = pipeline_bubble(
            plan.schedule, plan.pp_degree, plan.stages_per_rank, plan.n_microbatches
        )
        add(
            f"pipeline: {plan.schedule}, {plan.num_stages} stages ({plan.stages_per_rank} per rank), "
            f"{plan.n_microbatches} microbatches of {mb} sequence(s)"
        )
        add(f"  {plan.describe()}")
        add(
            f"  bubble: (pp - 1) / (stages per rank x microbatches) = {bubble:.1%} of the busy "
            f"time; in flight on pp rank 0: "
            f"{in_flight_microbatches(plan, 0)} microbatch-stage(s)"
        )
        if plan.n_microbatches < 2 * plan.num_stages:
            warnings.append(
                f"pipeline microbatches ({plan.n_microbatches}) below 2 x stages "
                f"({2 * plan.num_stages}): the bubble is {bubble:.0%}; use more microbatches "
                "(a larger local batch or --parallelism.pipeline_parallel_microbatches)"
            )
    est = estimate_memory(cfg, world_size, device_type=device_type, model_args=args)
    add("memory per rank (estimate):")
    add("\n".join("  " + line for line in est.table().splitlines()))
    add(memory_levers_line(cfg, est))
    lines.extend(estimate_notes(est))
    warnings += _warnings(cfg, dims, est, accum, device_type, device_memory_bytes)
    if warnings:
        add("warnings:")
        lines += [f"  - {w}" for w in warnings]
    else:
        add("warnings: none")
    return "\n".join(lines)


def _warnings(
    cfg: JobConfig,
    dims: ParallelDims,
    est: MemoryEstimate,
    accum: int,
    device_type: str,
    device_memory_bytes: int | None,
) -> list[str]:
    out: list[str] = []
    if device_memory_bytes is None and device_type == "cuda" and torch.cuda.is_available():
        device_memory_bytes = torch.cuda.get_device_properties(0).total_memory
    if device_memory_bytes is not None and est.total > device_memory_bytes:
        out.append(
            f"the estimate ({est.total / GIB:.1f} GiB) exceeds the device memory "
            f"({device_memory_bytes / GIB:.1f} GiB): expect out-of-memory; try activation "
            "checkpointing, more FSDP shards, or `python -m torchtitan.planner`"
        )
    if dims.fsdp_enabled and accum > 1 and not dims.pp_enabled:
        out.append(
            f"{accum} gradient-accumulation steps under FSDP all-gather the parameters again on "
            "every micro-step; a larger local batch (if it fits) moves less data"
        )
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    if dims.tp > 1 and local_world and dims.tp * dims.cp > local_world:
        out.append(
            f"tp x cp = {dims.tp * dims.cp} is more than the {local_world} ranks of a node: the "
            "per-layer activation collectives would cross nodes"
        )
    if dims.ddp_enabled and est.parameters > 4 * GIB:
        out.append(
            "DDP keeps a full copy of parameters, gradients and optimizer state on every rank; "
            "FSDP (data_parallel_shard_degree) divides them"
        )
    return out


def _attention_line(cfg: JobConfig, device_type: str, cp: int) -> str:
    """The mask, the kernel that runs it and how MFU counts it (docs/attention.md)."""
    m = cfg.model
    if m.attn_mask_type == "causal":
        return "attention: causal (SDPA is_causal); MFU counts causal attention FLOPs"
    backend = resolve_attn_backend(m.attn_backend, device_type, cp > 1)
    kernel = "FlexAttention + BlockMask" if backend == "flex" else "SDPA + dense boolean mask"
    pos = "per-document" if cfg.training.document_positions else "window"
    return (
        f"attention: block_causal (documents split at EOS), {kernel}, {pos} RoPE positions; "
        "MFU counts causal attention FLOPs (skipped blocks too: an upper bound)"
    )


def _vision_lines(cfg: JobConfig, args: Any, flops_per_token: int) -> list[str]:
    """The tower's parameters and its share of a step's FLOPs (no line without a tower)."""
    v = getattr(args, "vision", None)
    if v is None:
        return []
    t = cfg.training
    patches = t.image_tokens_per_sample * v.spatial_merge_size**2
    tower = tower_training_flops(v, patches)
    share = tower / (flops_per_token * t.seq_len) if flops_per_token else 0.0
    head = (
        f"vision tower: {v.num_params() / 1e6:,.1f} M parameters (in the memory estimate "
        f"with its activations, on the first pipeline stage), {v.depth} blocks of width {v.dim}"
    )
    if not patches:
        return [
            head,
            "  training.image_tokens_per_sample = 0: FLOPs per token and MFU count the "
            "decoder only; set it to the data's mean image tokens per sample",
        ]
    return [
        head,
        f"  {t.image_tokens_per_sample} image tokens per sample = {patches} patches: "
        f"{tower / 1e9:,.2f} GFLOP per sample, {share:.1%} of a step's FLOPs "
        f"(counted in MFU; training.image_tokens_per_sample)",
    ]
