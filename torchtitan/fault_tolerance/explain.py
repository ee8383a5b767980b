"""``--job.explain``'s lines for replica fault tolerance with torchft (docs/fault_tolerance.md):
the replica-group layout, the cross-group traffic (every step, or every sync_every steps under
semi_sync) and the extra memory (fault_tolerance/memory.py)."""

from __future__ import annotations

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.fault_tolerance.memory import fault_tolerance_memory
from torchtitan.fault_tolerance.outer_state import outer_settings

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
    lines = [
        f"fault tolerance (torchft): this job is replica group {ft.replica_id} of {groups}; the "
        f"replicate dimension is the {groups} jobs ({groups * dims.dp_degree} data shards, "
        f"{groups} x the global batch per step), min {ft.min_replicas} live group(s)",
    ]
    if ft.semi_sync == "none":
        lines.append(
            f"  cross-group gradients: each rank all-reduces its {shard / MIB:,.1f} MiB gradient "
            f"shard with the same rank of every live group: ~{ring / MIB:,.1f} MiB sent per step"
        )
    else:
        what = "parameter" if ft.semi_sync == "local_sgd" else "pseudo-gradient"
        lines.append(
            f"  semi-synchronous ({ft.semi_sync}): inner steps send nothing across groups; every "
            f"{ft.sync_every} steps each rank all-reduces its {shard / MIB:,.1f} MiB {what} "
            f"shard: ~{ring / MIB:,.1f} MiB sent per sync, ~{ring / ft.sync_every / MIB:,.1f} "
            "MiB per step on average"
        )
        if ft.semi_sync == "diloco":
            lr, momentum = outer_settings(ft)
            lines.append(
                f"  DiLoCo outer optimizer: SGD lr {lr:g}, Nesterov momentum {momentum:g} "
                "(momentum 0: plain SGD)"
            )
    mem = fault_tolerance_memory(ft, int(shard), int(shard), int(2 * shard))
    assert mem is not None
    lines.append(
        f"  extra memory per rank: {mem.note.removeprefix('fault tolerance: ')}; device "
        f"{(mem.held + mem.sync) / MIB:,.1f} MiB ({mem.held / MIB:,.1f} MiB all step), host "
        f"{mem.host / MIB:,.1f} MiB; a healthy peer serves its live tensors without a copy"
    )
    return lines
