"""Config checks for the memory levers (docs/memory.md): chunked linear + cross-entropy,
low-precision optimizer state and master weights, FSDP CPU offload (part of ``validate_config``).
"""

from __future__ import annotations

from torchtitan.config.errors import ConfigError, require_int
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models import MODELS, flavor_args, flavor_of


def validate_memory_levers(cfg: JobConfig, world_size: int) -> None:
    """Raise ConfigError where a memory lever is set in a way it cannot work."""
    _validate_chunked_loss(cfg)
    _validate_optimizer_precision(cfg)
    _validate_offload(cfg, world_size)


def _validate_offload(cfg: JobConfig, world_size: int) -> None:
    if not cfg.parallelism.fsdp_cpu_offload:
        return
    dims = ParallelDims.from_config(cfg.parallelism, world_size)
    if dims.dp_replicate > 1 and dims.dp_shard * dims.cp == 1:
        raise ConfigError(
            "parallelism.fsdp_cpu_offload",
            True,
            f"offload is FSDP2's CPUOffloadPolicy, and this layout ({dims}) replicates with DDP "
            "(data_parallel_replicate_degree > 1, nothing sharded), whose whole parameters stay "
            "on the device",
            "shard instead (--parallelism.data_parallel_shard_degree "
            f"{dims.dp_replicate} --parallelism.data_parallel_replicate_degree 1) or remove "
            "--parallelism.fsdp_cpu_offload",
        )
    if dims.ep > 1:
        raise ConfigError(
            "parallelism.fsdp_cpu_offload",
            True,
            "expert-parallel experts are sharded apart from the FSDP units (their own DTensors "
            "on the ep mesh) and would stay on the device: offload would be partial",
            "remove --parallelism.fsdp_cpu_offload or use expert_parallel_degree = 1",
        )


def _validate_optimizer_precision(cfg: JobConfig) -> None:
    o, t = cfg.optimizer, cfg.training
    if o.master_weights_dtype == "bfloat16" and t.mixed_precision_param == "float32":
        raise ConfigError(
            "training.mixed_precision_param",
            t.mixed_precision_param,
            "bf16 master weights (optimizer.master_weights_dtype = bfloat16) compute in bf16",
            "use --training.mixed_precision_param auto (or bfloat16), or fp32 master weights",
        )


def _validate_chunked_loss(cfg: JobConfig) -> None:
    require_int(cfg, "training.loss_chunk_size", minimum=0)
    chunk = cfg.training.loss_chunk_size
    if chunk == 0 or cfg.model.name not in MODELS:
        return
    spec = MODELS[cfg.model.name]
    if flavor_of(cfg) in spec.flavors:
        plan = spec.parallel_plan(flavor_args(cfg))
        if plan.tensor_parallel.output is None:
            raise ConfigError(
                "training.loss_chunk_size",
                chunk,
                f"model {cfg.model.name} names no output projection in its parallel plan "
                "(TensorParallelPlan.output), so the loss cannot apply it a chunk at a time",
                "set --training.loss_chunk_size 0",
            )
    if cfg.compile.enable and "loss" in cfg.compile.components:
        raise ConfigError(
            "compile.components",
            cfg.compile.components,
            "chunked cross-entropy (training.loss_chunk_size > 0) recomputes each chunk under "
            "torch.utils.checkpoint and is not compiled; compiling the loss would not apply",
            "remove loss from --compile.components, or set --training.loss_chunk_size 0",
        )
    f8 = cfg.quantize.dense.float8
    if f8.enable and not any("output" in f for f in f8.filter_fqns):
        raise ConfigError(
            "quantize.dense.float8.filter_fqns",
            f8.filter_fqns,
            "chunked cross-entropy applies the output projection in high precision itself, so "
            "float8 cannot convert it",
            "keep output in --quantize.dense.float8.filter_fqns, or set "
            "--training.loss_chunk_size 0",
        )
