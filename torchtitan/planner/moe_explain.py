"""The Mixture-of-Experts lines of ``--job.explain`` (docs/moe.md): total vs active parameters,
the experts each rank holds and their memory, and the all-to-all volume of expert parallel.

Closed form, so it costs nothing for the 235B flavor. The expert elements per rank and the
all-to-all bytes come from ``planner/moe_memory.py``, the functions the memory estimate (printed
below these lines, experts included) and the planner use.
"""

from __future__ import annotations

from typing import Any

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models import MODELS
from torchtitan.planner.estimator import (
    format_bytes,
    master_weight_bytes,
    optimizer_state_bytes_per_param,
    param_dtype_bytes,
)
from torchtitan.planner.moe_memory import (
    all_to_all_bytes,
    expert_layout,
    layer_expert_elems,
    moe_layers_per_rank,
)
from torchtitan.preflight.validate import pipeline_stages


def moe_lines(cfg: JobConfig, args: Any, dims: ParallelDims, device_type: str) -> list[str]:
    """Nothing for a dense model."""
    moe = getattr(args, "moe", None)
    if moe is None:
        return []
    n_layers = moe_layers_per_rank(args, _blocks_of_ranks(cfg, args))
    total, active = int(args.num_params()), int(args.num_params(active=True))
    act = param_dtype_bytes(cfg, device_type)
    n_shard = dims.dp_shard * dims.cp
    lay = expert_layout(moe, dims.ep, n_shard, dims.fsdp_enabled)
    stored, gathered = layer_expert_elems(args, dims.ep, n_shard, dims.fsdp_enabled)
    held = n_layers * stored
    # The stored shard, its gradient and the optimizer moments (the estimator's byte counts).
    per_elem = 2 * master_weight_bytes(cfg) + optimizer_state_bytes_per_param(
        cfg.optimizer.moments_dtype
    )
    tokens = cfg.training.local_batch_size * cfg.training.seq_len // dims.cp
    where = f" (pp rank with the most: {n_layers} MoE layers)" if dims.pp > 1 else ""
    lines = [
        f"experts: {int(args.n_moe_layers)} MoE layers x {moe.num_experts} experts (top-{moe.top_k}, width "
        f"{moe.expert_dim}, {moe.num_shared_experts} shared); {total / 1e9:,.2f} B parameters, "
        f"{active / 1e9:,.2f} B active per token ({active / total:.1%})",
        f"  per rank{where}: {lay.local_experts} experts per layer (ep={lay.ep}), sharded over "
        f"efsdp={lay.efsdp}: {held / 1e6:,.1f} M expert parameters, "
        f"{format_bytes(held * per_elem)} with gradients and optimizer states; "
        f"{format_bytes(gathered * act)} gathered per MoE layer while it runs",
    ]
    if dims.ep > 1:
        one_way = all_to_all_bytes(args, tokens, act, dims.ep)
        lines.append(
            f"  all-to-all: {format_bytes(one_way)} sent per MoE layer and direction per "
            f"micro-step (uniform routing), {format_bytes(4 * n_layers * one_way)} per "
            "micro-step (dispatch + combine, forward + backward)"
        )
    lines.append(
        "  the memory estimate below counts them: router, experts per rank, shared experts and "
        "the routed rows each MoE block saves (docs/planning.md, MoE)"
    )
    return lines


def _blocks_of_ranks(cfg: JobConfig, args: Any) -> list[list[int]]:
    """Each pipeline rank's block ids (all blocks on one rank without pipeline parallel)."""
    plan = pipeline_stages(cfg)
    if plan is None:
        return [list(range(args.n_layers))]
    prefix = MODELS[cfg.model.name].parallel_plan(args).blocks + "."
    return [
        [
            int(u[len(prefix) :])
            for s in plan.stage_ids(r)
            for u in plan.stage_units[s]
            if u.startswith(prefix)
        ]
        for r in range(plan.pp_degree)
    ]
