"""``--job.explain``'s lines for replica fault tolerance with torchft (docs/fault_tolerance.md):
the replica-group layout, the cross-group gradient traffic and the extra memory."""

from __future__ import annotations

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims

MIB = 2**20


def fault_tolerance_lines(cfg: JobConfig, dims: ParallelDims, num_params: int) -> list[str]:
    """Nothing without fault_tolerance.enable. Sizes assume fp32 parameters and gradients and
    an optimizer state of two moments (AdamW); a rank's share is the parameters over
    dp_shard x cp x tp x pp."""
    ft = cfg.fault_tolerance
    if not ft.enable:
        return []
    groups = ft.group_size
    shard = num_params * 4 / (dims.dp_shard * dims.cp * dims.tp * dims.pp)
    ring = 2 * (groups - 1) / groups * shard  # bytes one rank sends in a ring all-reduce
    return [
        f"fault tolerance (torchft): this job is replica group {ft.replica_id} of {groups}; the "
        f"replicate dimension is the {groups} jobs ({groups * dims.dp_degree} data shards, "
        f"{groups} x the global batch per step), min {ft.min_replicas} live group(s)",
        f"  cross-group gradients: each rank all-reduces its {shard / MIB:,.1f} MiB gradient "
        f"shard with the same rank of every live group: ~{ring / MIB:,.1f} MiB sent per step",
        f"  extra memory per rank: the flattened gradient copy of the all-reduce "
        f"({shard / MIB:,.1f} MiB); a recovering rank receives model + optimizer state "
        f"(~{3 * shard / MIB:,.1f} MiB) before loading it; a healthy peer serves its live "
        "tensors without a copy",
    ]
