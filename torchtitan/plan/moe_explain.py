"""The Mixture-of-Experts lines of ``--job.explain`` (docs/moe.md): total vs active parameters,
the experts each rank holds and their memory, and the all-to-all volume of expert parallel.

Closed form from the flavor's ``moe`` arguments, so it costs nothing for the 235B flavor. The
memory estimator below these lines still models every block as a dense one (its SwiGLU width
``intermediate_size``); these lines give the expert memory it leaves out.
"""

from __future__ import annotations

from typing import Any

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.utils import resolve_dtype

GIB = 1024**3


def moe_lines(cfg: JobConfig, args: Any, dims: ParallelDims, device_type: str) -> list[str]:
    """Nothing for a dense model."""
    moe = getattr(args, "moe", None)
    if moe is None:
        return []
    n_layers = int(args.n_moe_layers)
    total, active = int(args.num_params()), int(args.num_params(active=True))
    act = resolve_dtype(cfg.training.mixed_precision_param, device_type).itemsize
    ep = dims.ep
    efsdp = dims.dp_shard // ep
    per_expert = 3 * args.dim * moe.expert_dim
    held = n_layers * moe.num_experts * per_expert / (ep * efsdp)
    # FSDP keeps the sharded parameters, their gradients and the two AdamW moments in fp32
    # (the param dtype copy is gathered only while a block runs).
    state_bytes = held * 16
    tokens = cfg.training.local_batch_size * cfg.training.seq_len // dims.cp
    lines = [
        f"experts: {n_layers} MoE layers x {moe.num_experts} experts (top-{moe.top_k}, width "
        f"{moe.expert_dim}, {moe.num_shared_experts} shared); {total / 1e9:,.2f} B parameters, "
        f"{active / 1e9:,.2f} B active per token ({active / total:.1%})",
        f"  per rank: {moe.num_experts // ep} experts per layer (ep={ep}), sharded over "
        f"efsdp={efsdp}: {held / 1e6:,.1f} M expert parameters, {state_bytes / GIB:.2f} GiB with "
        f"gradients and AdamW states",
    ]
    if ep > 1:
        # Uniform routing: (ep - 1) / ep of a rank's routed slots leave it, once in the
        # dispatch and once in the combine, forward and again backward.
        one_way = tokens * moe.top_k * args.dim * act * (ep - 1) / ep
        per_step = 4 * n_layers * one_way
        lines.append(
            f"  all-to-all: {one_way / 2**20:,.1f} MiB sent per MoE layer and direction per "
            f"micro-step (uniform routing), {per_step / GIB:.2f} GiB per micro-step "
            "(dispatch + combine, forward + backward)"
        )
    lines.append("  (the memory estimate below models every block as dense: add these experts)")
    return lines
