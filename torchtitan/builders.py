"""The pieces the Trainer builds, one function each, in the order ``Trainer.__init__`` calls
them (docs/architecture.md, section 3). Each takes the config and what was built before it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.checkpoint.manager import CheckpointManager
from torchtitan.checkpoint.safety import resume_settings
from torchtitan.config.job_config import JobConfig
from torchtitan.data.builder import DataOptions, build_data_loader
from torchtitan.data.chat_data import ChatDataset
from torchtitan.data.dataloader import ParallelAwareDataloader
from torchtitan.data.tokenizer import AnyTokenizer
from torchtitan.distributed.compile import compile_loss, set_compile_cache_dir
from torchtitan.distributed.float8 import apply_float8
from torchtitan.distributed.float8_grouped import apply_float8_experts
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.parallelize import parallelize
from torchtitan.distributed.pipeline_parallel import split_model
from torchtitan.distributed.pipeline_plan import PipelinePlan
from torchtitan.eval.harness import Evaluator, make_lm
from torchtitan.eval.validation_loss import Validator
from torchtitan.lora.apply import (
    apply_lora,
    base_init_only,
    freeze_base,
    init_adapters,
    with_targets,
)
from torchtitan.lora.layers import is_adapter_name
from torchtitan.lora.peft_io import load_into
from torchtitan.loss.cross_entropy import cross_entropy_sum
from torchtitan.metrics.processor import MetricsProcessor
from torchtitan.metrics.writers import MetricWriter, build_job_writers
from torchtitan.models.spec import ModelSpec, TrainableModel
from torchtitan.tools import startup
from torchtitan.tools.device_memory import DeviceMemoryMonitor
from torchtitan.tools.logging import logger
from torchtitan.tools.memory_monitor import MemoryMonitor
from torchtitan.tools.peak_flops import datasheet_peak_flops, measure_matmul_peak_flops
from torchtitan.tools.profiling import Profiling
from torchtitan.tools.stragglers import StragglerFlag

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def build_rank_dataloader(
    cfg: JobConfig,
    dims: ParallelDims,
    tokenizer: AnyTokenizer,
    dataset: str,
    dataset_path: str | None,
    split: str,
    infinite: bool,
) -> ParallelAwareDataloader:
    """A loader sharded by this rank's data-parallel coordinate only (TP/CP/PP peers share)."""
    t, dp_mesh = cfg.training, dims.get_mesh("dp")
    if dataset == "chat":  # chat SFT rows with prompt-masked labels (docs/sft.md)
        return build_chat_dataloader(cfg, dataset_path, tokenizer, dp_mesh, infinite)
    options = DataOptions(t.tokenized_shuffle, cfg.debug.seed, t.mixture, t.mixture_exhausted)
    return build_data_loader(
        dataset=dataset,
        dataset_path=dataset_path,
        tokenizer=tokenizer,
        seq_len=t.seq_len,
        local_batch_size=t.local_batch_size,
        dp_rank=dp_mesh.get_local_rank(),
        dp_world_size=dp_mesh.size(),
        split=split,
        infinite=infinite,
        sharding=t.data_sharding,
        with_doc_ids=cfg.model.attn_mask_type == "block_causal",
        options=options,
    )


def build_chat_dataloader(
    cfg: JobConfig,
    path: str | None,
    tokenizer: AnyTokenizer,
    dp_mesh: DeviceMesh,
    infinite: bool,
) -> ParallelAwareDataloader:
    """The ``chat`` dataset's loader for this data-parallel rank (``[sft]`` options)."""
    assert path is not None  # preflight requires a dataset_path for "chat"
    rank, world = dp_mesh.get_local_rank(), dp_mesh.size()
    chat = ChatDataset(
        path,
        tokenizer,
        cfg.training.seq_len,
        dp_rank=rank,
        dp_world_size=world,
        infinite=infinite,
        packing=cfg.sft.packing,
        overlong=cfg.sft.overlong,
        template=cfg.sft.chat_template,
        with_doc_ids=cfg.model.attn_mask_type == "block_causal",
    )
    return ParallelAwareDataloader(chat, rank, world, batch_size=cfg.training.local_batch_size)


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
    pp_plan: PipelinePlan | None,
    dtypes: tuple[torch.dtype, torch.dtype],
    device: torch.device,
) -> list[nn.Module]:
    """The modules this rank trains, parallelized, materialized and initialized: the model, or
    under PP one copy of the meta model per local stage with only what that stage owns."""
    plan = spec.parallel_plan(args)
    if pp_plan is None:
        parts = [model]
    else:
        pp_rank = dims.coordinates()["pp"]
        parts = [
            split_model(model, plan.pipeline_units, pp_plan.stage_units[i])
            for i in pp_plan.stage_ids(pp_rank)
        ]
    parts = [parallelize(part, plan, dims, cfg, *dtypes) for part in parts]
    startup.mark("parallelize")
    defer = defers_init(cfg)  # then the trainer calls init_model_weights after the load
    for part in parts:
        # Under FSDP CPU offload the parameter shards live on the host (docs/memory.md).
        part.to_empty(device="cpu" if cfg.parallelism.fsdp_cpu_offload else device)
        init_buffers = getattr(part, "init_buffers", None)
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
        if getattr(part, "init_buffers", None) is not None:
            cast(TrainableModel, part).init_weights(seed=cfg.debug.seed, buffer_device=device)
    startup.mark("init weights")


def defers_init(cfg: JobConfig) -> bool:
    """Whether the weights are initialised after the checkpoint load, and only if it loaded no
    model (checkpointing on, not a seed checkpoint, no LoRA, whose init also freezes the base
    and seeds the adapters): a load would overwrite them."""
    lora = cfg.lora.enable
    return cfg.checkpoint.enable and not cfg.checkpoint.create_seed_checkpoint and not lora


def peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """The peak FLOP/s MFU is measured against: a known GPU's datasheet, else a matmul timed here."""
    peak = datasheet_peak_flops(device, dtype)
    if peak is not None:
        return peak, "datasheet"
    return measure_matmul_peak_flops(device, dtype), "measured matmul"


def build_metrics(
    cfg: JobConfig,
    dims: ParallelDims,
    pp_plan: PipelinePlan | None,
    device: torch.device,
    rank: int,
    flops_per_token: int,
    peak: tuple[float, str],
) -> tuple[MetricsProcessor, list[MetricWriter]]:
    """The metrics processor (loss, throughput, MFU, memory) and the writers it feeds."""
    m = cfg.metrics
    writers = build_job_writers(cfg, rank, write_this_rank=m.save_for_all_ranks or rank == 0)
    memory = MemoryMonitor(
        DeviceMemoryMonitor(device),
        rank=rank,
        warmup_steps=m.memory_warmup_steps,
        leak_window=m.memory_leak_window,
        leak_min_growth_mib=m.memory_leak_min_growth_mib,
        trace_path=f"{cfg.job.dump_folder}/memory/rank_{rank}.jsonl"
        if m.enable_memory_trace
        else None,
    )
    processor = MetricsProcessor(
        device=device,
        log_freq=m.log_freq,
        total_steps=cfg.training.steps,
        loss_mesh=dims.get_mesh("dp_cp"),
        flops_per_token=flops_per_token,
        peak_flops=peak[0],
        peak_flops_source=peak[1],
        writers=writers,
        pp_mesh=dims.get_mesh("pp") if pp_plan else None,
        pp_loss_rank=pp_plan.last_stage_pp_rank if pp_plan else 0,
        memory_monitor=memory,
        cross_rank_view=m.enable_cross_rank_view or cfg.fault_tolerance.straggler_margin > 0,
        stragglers=StragglerFlag(
            cfg.fault_tolerance.straggler_margin, cfg.fault_tolerance.straggler_log_steps
        )
        if cfg.fault_tolerance.straggler_margin > 0
        else None,
    )
    return processor, writers


def build_profiling(cfg: JobConfig, rank: int, device: torch.device) -> Profiling:
    return Profiling(cfg.job.dump_folder, cfg.profiling, rank, device.type)


def build_checkpointer(
    cfg: JobConfig,
    spec: ModelSpec,
    args: Any,
    model_parts: list[nn.Module],
    optimizer: torch.optim.Optimizer,
    lr_scheduler: Any,
    dataloader: ParallelAwareDataloader,
) -> CheckpointManager:
    ck = cfg.checkpoint
    return CheckpointManager(
        root=Path(cfg.job.dump_folder) / ck.folder,
        interval=ck.interval,
        keep_latest_k=ck.keep_latest_k,
        async_mode=ck.async_mode,
        load_step=ck.load_step,
        total_steps=cfg.training.steps,
        model_parts=model_parts,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        dataloader=dataloader,
        verify_checksums=ck.verify_checksums,
        exclude_from_loading=tuple(ck.exclude_from_loading),
        initial_load_path=ck.initial_load_path,
        initial_load_model_only=ck.initial_load_model_only,
        initial_load_in_hf=ck.initial_load_in_hf,
        hf_adapter=spec.state_dict_adapter(args) if ck.initial_load_in_hf else None,
        last_save_model_only=ck.last_save_model_only,
        export_dtype=getattr(torch, ck.export_dtype),
        resume_settings=resume_settings(cfg),
    )


def build_loss_fn(cfg: JobConfig, dims: ParallelDims) -> LossFn:
    """Summed token cross-entropy, compiled (lazily, at its first call) when compile lists the
    loss; the step's ``loss_scale`` makes it the global-batch mean (docs/sft.md)."""
    if not cfg.compile.enable:
        return cross_entropy_sum
    # Ranks at different TP/CP coordinates compile different graphs: separate caches.
    coords = dims.coordinates()
    cache = set_compile_cache_dir(
        cfg.compile.cache_dir,
        base_folder=cfg.job.dump_folder,
        rank_subdir=f"tp{coords['tp']}_cp{coords['cp']}"
        if dims.tp_enabled or dims.cp_enabled
        else None,
    )
    logger.info(f"compile cache: {cache}")
    if "loss" in cfg.compile.components:
        return compile_loss(cross_entropy_sum, backend=cfg.compile.backend)
    return cross_entropy_sum


def build_validator(
    cfg: JobConfig,
    dims: ParallelDims,
    tokenizer: AnyTokenizer,
    model_parts: list[nn.Module],
    device: torch.device,
    writers: list[MetricWriter],
    loss_fn: Callable[..., tuple[torch.Tensor, int] | None],
) -> Validator:
    """The validation-loss runner over ``validation.dataset`` (docs/observability.md)."""
    v = cfg.validation
    loader = build_rank_dataloader(
        cfg, dims, tokenizer, v.dataset, v.dataset_path, "validation", False
    )
    return Validator(
        dataloader=loader,
        freq=v.freq,
        steps=v.steps,
        loss_fn=loss_fn,
        batch_size=cfg.training.local_batch_size,
        model_parts=model_parts,
        device=device,
        writers=writers,
        dp_mesh=dims.get_mesh("dp"),
        loss_mesh=dims.get_mesh("dp_cp"),
        pp_mesh=dims.get_mesh("pp") if dims.pp_enabled else None,
    )


def build_evaluator(
    cfg: JobConfig,
    tokenizer: AnyTokenizer,
    model_parts: list[nn.Module],
    device: torch.device,
    writers: list[MetricWriter],
) -> Evaluator:
    """lm-eval tasks on the model being trained, every ``eval.freq`` steps (docs/evaluation.md).
    Every rank evaluates every request: under FSDP the ranks' forwards must pair up."""
    lm = make_lm(model_parts[0], tokenizer, cfg.training.seq_len, device, cfg.eval)
    return Evaluator(lm, cfg.eval, writers, model_parts=model_parts, seed=cfg.debug.seed)
