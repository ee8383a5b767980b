"""The Llama 3 parallelization plan, applied in a fixed order.

Order and why:
1. Tensor parallel (with sequence and loss parallel) first: it rewrites parameters into DTensors
   on the ``tp`` axis, which FSDP then shards further on the data axes (2-D).
2. Context parallel: swaps the attention core for one that gathers K/V over ``cp``.
3. Activation checkpointing wraps whole blocks, so it must see the final block modules.
4. torch.compile per block, after AC so the recomputation is compiled too, before FSDP so FSDP's
   hooks stay outside the compiled graph.
5. FSDP/HSDP (or DDP) last: it shards whatever parameters the steps above produced.
"""

from __future__ import annotations

import torch
from torch import nn

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.distributed.compile import apply_compile
from torchtitan.distributed.context_parallel import apply_cp
from torchtitan.distributed.data_parallel import apply_ddp, apply_fsdp, reshard_policy
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.tensor_parallel import apply_tp
from torchtitan.models.llama3.args import ModelArgs


def parallelize_llama(
    model: nn.Module,
    dims: ParallelDims,
    cfg: JobConfig,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
) -> nn.Module:
    mesh = dims.world_mesh
    # 1. Tensor parallel (with sequence and loss parallel).
    if dims.tp_enabled:
        par = cfg.parallelism
        apply_tp(
            model,
            dims.get_mesh("tp"),
            loss_parallel=not par.disable_loss_parallel,
            enable_async_tp=par.enable_async_tensor_parallel,
        )
    # 2. Context parallel: K/V gathered over cp, RoPE by global positions.
    if dims.cp_enabled:
        args: ModelArgs = model.args  # type: ignore[assignment]
        apply_cp(
            model,
            dims.get_mesh("cp"),
            n_rep=args.n_heads // args.kv_heads,
            method=cfg.parallelism.context_parallel_method,
        )
    # 3. Activation checkpointing.
    ac = cfg.activation_checkpoint
    apply_ac(model, ac.mode, ac.selective_ac_option)
    # 4. Per-block compile.
    if cfg.compile.enable and "model" in cfg.compile.components:
        apply_compile(model, backend=cfg.compile.backend, tp_enabled=dims.tp_enabled)
    # 5. Data parallel.
    if dims.fsdp_enabled:
        apply_fsdp(
            model,
            dims.fsdp_mesh(),
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            reshard_after_forward=reshard_policy(
                cfg.parallelism.fsdp_reshard_after_forward, dims.pp_enabled
            ),
        )
    elif dims.ddp_enabled:
        apply_ddp(model, mesh["dp_replicate"], param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    return model
