"""Apply a model's parallel plan, in a fixed order, to a model (or one pipeline stage of it).

Order and why (docs/architecture.md, section 5):
1. Expert parallel (MoE models): the experts become DTensors on ``ep`` before anything else, so
   tensor parallel leaves them alone and FSDP knows to shard them over ``efsdp``.
2. The deferred output projection (``training.loss_chunk_size`` > 0): the loss will apply it.
3. Tensor parallel (with sequence and loss parallel): it rewrites parameters into DTensors on the
   ``tp`` axis, which FSDP then shards further on the data axes (2-D).
4. Context parallel: swaps the attention core for one that gathers K/V over ``cp``.
5. Activation checkpointing wraps whole blocks (the plan's ``blocks`` and ``extra_blocks``), so
   it must see the final block modules.
6. torch.compile per block (the same blocks), after AC so the recomputation is compiled too, before FSDP so FSDP's
   hooks stay outside the compiled graph.
7. FSDP/HSDP (or DDP) last: it shards whatever parameters the steps above produced.
"""

from __future__ import annotations

import torch
from torch import nn

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.distributed.compile import apply_compile
from torchtitan.distributed.context_parallel import apply_cp
from torchtitan.distributed.data_parallel import apply_ddp, apply_fsdp, reshard_policy
from torchtitan.distributed.expert_parallel import apply_ep, apply_expert_fsdp
from torchtitan.distributed.model_plan import ModelParallelPlan, submodule_or_none
from torchtitan.distributed.output_head import defer_output
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.tensor_parallel import apply_tp


def parallelize(
    model: nn.Module,
    plan: ModelParallelPlan,
    dims: ParallelDims,
    cfg: JobConfig,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
) -> nn.Module:
    """``model`` with the parallelisms of ``dims`` and the speed features of ``cfg`` applied."""
    blocks = plan.blocks_of(model)
    par = cfg.parallelism
    # Expert parallel first: the experts become DTensors on ``ep`` (TP leaves DTensors alone,
    # FSDP shards them over efsdp, replicates them over dp_replicate, or leaves them alone).
    experts = apply_ep(model, dims.get_mesh("ep")) if dims.ep > 1 else []
    deferred = cfg.training.loss_chunk_size > 0  # the loss applies the output projection
    if deferred:
        defer_output(model, plan.tensor_parallel.output)
    if dims.tp_enabled:
        apply_tp(
            model,
            blocks,
            dims.get_mesh("tp"),
            plan.tensor_parallel,
            loss_parallel=not par.disable_loss_parallel,
            enable_async_tp=par.enable_async_tensor_parallel,
            output_deferred=deferred,
        )
    if dims.cp_enabled:
        cp = plan.context_parallel
        assert cp is not None, "config validation refuses CP for models without a CP plan"
        apply_cp(
            model,
            blocks,
            dims.get_mesh("cp"),
            cp.attention_core,
            n_rep=cp.kv_repeat,
            method=par.context_parallel_method,
            document_mask=cfg.model.attn_mask_type == "block_causal",
            # auto is sdpa under CP (models/common/attention.py: resolve_attn_backend)
            attn_backend="flex" if cfg.model.attn_backend == "flex" else "sdpa",
        )
    ac = cfg.activation_checkpoint
    extra = [submodule_or_none(model, path) for path in plan.extra_blocks]
    containers = [blocks, *(c for c in extra if isinstance(c, nn.ModuleList | nn.ModuleDict))]
    for container in containers:
        apply_ac(container, ac.mode, ac.selective_ac_option)
    if cfg.compile.enable and "model" in cfg.compile.components:
        embedding = submodule_or_none(model, plan.embedding) if plan.embedding else None
        apply_compile(
            blocks,
            backend=cfg.compile.backend,
            wait_on=embedding if dims.tp_enabled else None,
            inside_checkpoint=dims.tp_enabled,
        )
        for container in containers[1:]:
            apply_compile(container, backend=cfg.compile.backend)
    if dims.fsdp_enabled:
        reshard = reshard_policy(par.fsdp_reshard_after_forward, dims.pp_enabled)
        if experts and (dims.efsdp > 1 or dims.dp_replicate_enabled):
            mesh = dims.get_mesh("expert_fsdp")
            apply_expert_fsdp(model, experts, mesh, param_dtype, reduce_dtype, reshard)
            experts = []  # nested FSDP units now: the blocks' FSDP skips them
        # (a unit a pipeline stage does not hold is not there: the first stage's vision tower)
        units = [m for path in plan.fsdp_units if (m := submodule_or_none(model, path)) is not None]
        apply_fsdp(
            model,
            units + list(blocks.values()),
            dims.fsdp_mesh(),
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            reshard_after_forward=reshard,
            ignored_params=set(experts),
            cpu_offload=par.fsdp_cpu_offload,
        )
    elif dims.ddp_enabled:
        apply_ddp(model, dims.get_mesh("dp_replicate"), param_dtype, reduce_dtype)
    return model
