"""The model a rank trains, built across the layers (models, converters in distributed/ and
lora/, parallelize): the meta model, the parallelized and initialized parts, their deferred
initial weights (docs/architecture.md, section 3). The other pieces the Trainer builds are
built beside their components (``data/rank_loader.py``, ``metrics/processor.py:
build_metrics``, ``eval/``, ``checkpoint/from_config.py``, ``loss/cross_entropy.py:
build_loss_fn``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.float8 import apply_float8
from torchtitan.distributed.float8_grouped import apply_float8_experts
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.parallelize import parallelize
from torchtitan.distributed.pipeline_parallel import split_model
from torchtitan.distributed.pipeline_stages import PipelineStages
from torchtitan.lora.apply import (
    apply_lora,
    base_init_only,
    freeze_base,
    init_adapters,
    with_targets,
)
from torchtitan.lora.layers import is_adapter_name
from torchtitan.lora.peft_io import load_into
from torchtitan.models.spec import ModelSpec, TrainableModel, buffer_init
from torchtitan.tools import startup
from torchtitan.tools.logging import logger


def build_meta_model(
    cfg: JobConfig, spec: ModelSpec, args: Any, dims: ParallelDims, device: torch.device
) -> nn.Module:
    """The whole model on the meta device, with the converters (float8 linears) applied."""
    with torch.device("meta"):
        model = spec.build(args)
    logger.info(f"model {cfg.model.name} {cfg.model.flavor}: {spec.num_params(args):,} parameters")
    startup.mark("meta build")
    f8 = cfg.quantize.dense.float8
    if f8.enable:
        apply_float8(
            model,
            recipe_name=f8.recipe_name,
            filter_fqns=f8.filter_fqns,
            auto_filter_small_kn=f8.auto_filter_small_kn,
            enable_fsdp_float8_all_gather=f8.enable_fsdp_float8_all_gather and dims.fsdp_enabled,
            emulate=f8.emulate,
            device_type=device.type,
            head=spec.parallel_plan(args).head,
        )
    if cfg.quantize.moe.float8.enable:  # the routed experts' grouped GEMMs (docs/float8.md)
        apply_float8_experts(model, cfg.quantize.moe.float8.emulate, device.type)
    if cfg.lora.enable:  # adapters before parallelize, so its plans see them (docs/lora.md)
        adapted = apply_lora(model, with_targets(cfg.lora, spec, args))
        logger.info(f"lora: rank {cfg.lora.rank} adapters on {len(adapted)} modules")
    return model


def build_model_parts(
    cfg: JobConfig,
    spec: ModelSpec,
    args: Any,
    model: nn.Module,
    dims: ParallelDims,
    pp_stages: PipelineStages | None,
    dtypes: tuple[torch.dtype, torch.dtype],
    device: torch.device,
) -> list[nn.Module]:
    """The modules this rank trains, parallelized, materialized and initialized: the model, or
    under PP one copy of the meta model per local stage with only what that stage owns."""
    plan = spec.parallel_plan(args)
    if pp_stages is None:
        parts = [model]
    else:
        pp_rank = dims.coordinates()["pp"]
        parts = [
            split_model(model, plan.pipeline_units, pp_stages.stage_units[i])
            for i in pp_stages.stage_ids(pp_rank)
        ]
    parts = [parallelize(part, plan, dims, cfg, *dtypes) for part in parts]
    startup.mark("parallelize")
    defer = defers_init(cfg)  # then the trainer calls init_model_weights after the load
    for part in parts:
        # Under FSDP CPU offload the parameter shards live on the host (docs/memory.md).
        part.to_empty(device="cpu" if cfg.parallelism.fsdp_cpu_offload else device)
        init_buffers = buffer_init(part)
        if defer and init_buffers is not None:
            init_buffers(device)
        else:
            init_part(part, cfg.debug.seed, device, cfg.lora.enable)
        if cfg.lora.enable and cfg.lora.adapter_path:
            n = load_into(
                part, Path(cfg.lora.adapter_path), spec.state_dict_adapter(args), cfg.lora
            )
            logger.info(f"lora: {n} adapter tensors from {cfg.lora.adapter_path}")
        part.train()
    startup.mark("materialize" if defer else "materialize, init weights")
    return parts


def init_part(part: nn.Module, seed: int, device: torch.device, lora: bool) -> None:
    """The model's own init; with LoRA the base is frozen again (TP styles make new
    parameters), adapters get PEFT's init and checkpoints hold only them (docs/lora.md)."""
    if not lora:
        cast(TrainableModel, part).init_weights(seed=seed, buffer_device=device)
        return
    freeze_base(part)
    with base_init_only(part):
        cast(TrainableModel, part).init_weights(seed=seed, buffer_device=device)
    init_adapters(part, seed)
    part.checkpoint_keys = is_adapter_name  # type: ignore[assignment]


def init_model_weights(cfg: JobConfig, parts: list[nn.Module], device: torch.device) -> None:
    """The seeded initial weights of the parts whose initialisation was deferred (every part
    that has ``init_buffers``; the others were initialised already)."""
    if not defers_init(cfg):
        return
    for part in parts:
        if buffer_init(part) is not None:
            cast(TrainableModel, part).init_weights(seed=cfg.debug.seed, buffer_device=device)
    startup.mark("init weights")


def defers_init(cfg: JobConfig) -> bool:
    """Whether the weights are initialised after the checkpoint load, and only if it loaded no
    model (checkpointing on, not a seed checkpoint, no LoRA, whose init also freezes the base
    and seeds the adapters): a load would overwrite them."""
    lora = cfg.lora.enable
    return cfg.checkpoint.enable and not cfg.checkpoint.create_seed_checkpoint and not lora
