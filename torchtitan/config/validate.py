"""Cross-field checks, run before any process group or model exists.

Each failure is a ConfigError naming the field, the value, the rule and a fix.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig
from torchtitan.tools.logging import logger

if TYPE_CHECKING:
    from torchtitan.distributed.pipeline_parallel import PipelinePlan

# Fields whose feature is built by a later issue: using them is an error that says so.
_NOT_YET: list[tuple[str, str]] = []


def _get(cfg: JobConfig, dotted: str) -> object:
    obj: object = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def world_size_from_env() -> int:
    """The world size torchrun will give us (1 when launched without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def _positive(cfg: JobConfig, dotted: str, minimum: int = 1) -> None:
    v = _get(cfg, dotted)
    if not isinstance(v, int) or v < minimum:
        raise ConfigError(
            dotted, v, f"must be an integer >= {minimum}", f"set --{dotted} to at least {minimum}"
        )


def pipeline_plan(cfg: JobConfig) -> PipelinePlan | None:
    """The stages and microbatches the config asks for (None without PP); ConfigError if invalid."""
    from torchtitan.distributed.pipeline_parallel import (
        SCHEDULES,
        normalize_schedule_name,
        plan_pipeline,
    )
    from torchtitan.models import MODELS

    p = cfg.parallelism
    normalize_schedule_name(p.pipeline_parallel_schedule)  # a typo fails even without PP
    if p.pipeline_parallel_degree <= 1:
        return None
    args = MODELS[cfg.model.name].flavors[cfg.model.flavor]
    if getattr(args, "tie_word_embeddings", False):
        raise ConfigError(
            "parallelism.pipeline_parallel_degree",
            p.pipeline_parallel_degree,
            f"{cfg.model.flavor} ties the embedding and output weights, which pipeline parallel "
            "puts on different stages",
            "use a flavor with untied embeddings, or pipeline_parallel_degree 1",
        )
    plan = plan_pipeline(
        n_layers=args.n_layers,
        pp_degree=p.pipeline_parallel_degree,
        schedule=p.pipeline_parallel_schedule,
        split_points=p.pipeline_parallel_split_points,
        layers_per_stage=p.pipeline_parallel_layers_per_stage,
        microbatches=p.pipeline_parallel_microbatches,
        microbatch_size=p.pipeline_parallel_microbatch_size,
        local_batch_size=cfg.training.local_batch_size,
    )
    if cfg.compile.enable and SCHEDULES[plan.schedule].refuses_compile:
        raise ConfigError(
            "parallelism.pipeline_parallel_schedule",
            p.pipeline_parallel_schedule,
            f"torch's {plan.schedule} refuses compiled stages (it splits the backward into input "
            "and weight parts) and compile.enable is set",
            "use 1F1B, GPipe, Interleaved1F1B or LoopedBFS, or turn off compile.enable",
        )
    return plan


def validate_config(cfg: JobConfig, world_size: int | None = None) -> None:
    """Raise ConfigError on the first rule the config breaks."""
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.models import MODELS

    world_size = world_size_from_env() if world_size is None else world_size
    t, p = cfg.training, cfg.parallelism

    for dotted, feature in _NOT_YET:
        if _get(cfg, dotted):
            raise ConfigError(dotted, True, f"{feature} is not available yet", f"remove --{dotted}")
    _validate_speed_features(cfg)
    _validate_observability(cfg)
    _validate_checkpoint(cfg, world_size)

    # ---- model
    if cfg.model.name not in MODELS:
        raise ConfigError(
            "model.name", cfg.model.name, f"must be one of {list(MODELS)}", "pick a known model"
        )
    spec = MODELS[cfg.model.name]
    if cfg.model.flavor not in spec.flavors:
        raise ConfigError(
            "model.flavor",
            cfg.model.flavor,
            f"is not a flavor of {cfg.model.name}",
            f"pick one of {list(spec.flavors)}",
        )
    tok = Path(cfg.model.tokenizer_path)
    if not (tok.is_file() or (tok / "tokenizer.model").is_file()):
        raise ConfigError(
            "model.tokenizer_path",
            cfg.model.tokenizer_path,
            "must be a tiktoken ranks file or a folder with tokenizer.model",
            "point it at tests/assets/tokenizer or build one with scripts/train_tokenizer.py",
        )

    # ---- training
    for f in (
        "training.steps",
        "training.seq_len",
        "training.local_batch_size",
        "metrics.log_freq",
    ):
        _positive(cfg, f)
    _positive(cfg, "training.gc_freq", minimum=0)
    _positive(cfg, "lr_scheduler.warmup_steps", minimum=0)
    if not 0.0 <= cfg.lr_scheduler.decay_ratio <= 1.0:
        raise ConfigError(
            "lr_scheduler.decay_ratio",
            cfg.lr_scheduler.decay_ratio,
            "must be in [0, 1]",
            "use 1.0 for decay over all post-warm-up steps",
        )
    if not 0.0 <= cfg.lr_scheduler.min_lr_factor <= 1.0:
        raise ConfigError(
            "lr_scheduler.min_lr_factor",
            cfg.lr_scheduler.min_lr_factor,
            "must be in [0, 1]",
            "use e.g. 0.1",
        )
    if not 0.0 <= cfg.lr_scheduler.warmup_start_factor <= 1.0:
        raise ConfigError(
            "lr_scheduler.warmup_start_factor",
            cfg.lr_scheduler.warmup_start_factor,
            "must be in [0, 1]",
            "use 0.0",
        )
    if cfg.optimizer.lr <= 0:
        raise ConfigError("optimizer.lr", cfg.optimizer.lr, "must be > 0", "use e.g. 3e-4")

    # ---- parallelism
    dims = ParallelDims.from_config(p, world_size)
    pipeline_plan(cfg)  # split, schedule and microbatch checks (no-op without PP)
    _validate_tensor_parallel(cfg, dims.tp)
    _validate_context_parallel(cfg, dims.cp, dims.tp)

    per_step = t.local_batch_size * dims.dp_degree
    if t.global_batch_size != -1 and (
        t.global_batch_size <= 0 or t.global_batch_size % per_step != 0
    ):
        raise ConfigError(
            "training.global_batch_size",
            t.global_batch_size,
            f"must be -1 or a positive multiple of local_batch_size x dp degree = {t.local_batch_size} x {dims.dp_degree} = {per_step}",
            f"use {per_step} (no accumulation) or a multiple such as {2 * per_step}",
        )

    # ---- dtypes
    if t.mixed_precision_param == "bfloat16" and not torch.cuda.is_available():
        logger.warning(
            "training.mixed_precision_param = 'bfloat16' on a machine without CUDA: it works, "
            "but bf16 matmuls are far slower than fp32 on most CPUs (use 'auto' or 'float32')"
        )


def _validate_speed_features(cfg: JobConfig) -> None:
    """Activation checkpointing, compile and float8 options."""
    ac = cfg.activation_checkpoint
    if ac.mode == "selective":
        from torchtitan.distributed.activation_checkpoint import parse_selective_option

        try:
            parse_selective_option(ac.selective_ac_option)
        except ValueError:
            raise ConfigError(
                "activation_checkpoint.selective_ac_option",
                ac.selective_ac_option,
                "must be an integer >= 1 (checkpoint every Nth block) or 'op'",
                "use e.g. 2 or op",
            ) from None

    c = cfg.compile
    unknown = [x for x in c.components if x not in ("model", "loss")]
    if unknown or (c.enable and not c.components):
        raise ConfigError(
            "compile.components",
            c.components,
            "must list model and/or loss",
            "use model,loss",
        )

    f8 = cfg.quantize.dense.float8
    if not f8.enable:
        return
    if f8.enable_fsdp_float8_all_gather and f8.recipe_name != "tensorwise":
        raise ConfigError(
            "quantize.dense.float8.enable_fsdp_float8_all_gather",
            True,
            f"float8 all-gather of FSDP parameters needs the tensorwise recipe, not {f8.recipe_name}",
            "remove --quantize.dense.float8.enable_fsdp_float8_all_gather or use recipe_name "
            "tensorwise",
        )
    if f8.precompute_float8_dynamic_scale_for_fsdp and not f8.enable_fsdp_float8_all_gather:
        raise ConfigError(
            "quantize.dense.float8.precompute_float8_dynamic_scale_for_fsdp",
            True,
            "precomputes the scales that float8 all-gather uses, so it needs "
            "enable_fsdp_float8_all_gather",
            "add --quantize.dense.float8.enable_fsdp_float8_all_gather or remove the flag",
        )
    from torchtitan.distributed.float8 import float8_unsupported_reason
    from torchtitan.distributed.utils import device_type

    reason = float8_unsupported_reason(device_type(), emulate=f8.emulate)
    if reason is not None:
        raise ConfigError(
            "quantize.dense.float8.enable",
            True,
            f"float8 training cannot run here: {reason}",
            "remove --quantize.dense.float8.enable, or add --quantize.dense.float8.emulate to "
            "check the numerics without float8 hardware (no speed-up)",
        )


def _validate_tensor_parallel(cfg: JobConfig, tp: int) -> None:
    """Head counts, sequence length and widths divisible by TP; async TP's requirements."""
    from torchtitan.models import MODELS

    p = cfg.parallelism
    if p.enable_async_tensor_parallel:
        flag, fix = "parallelism.enable_async_tensor_parallel", "remove the flag"
        if not torch.cuda.is_available():
            raise ConfigError(
                flag,
                True,
                "async tensor parallel needs CUDA (symmetric memory and inductor's "
                "micro-pipelined matmuls) and no GPU is visible",
                "remove --parallelism.enable_async_tensor_parallel on CPU",
            )
        if tp < 2:
            raise ConfigError(flag, True, "needs tensor_parallel_degree >= 2", fix)
        if not (cfg.compile.enable and "model" in cfg.compile.components):
            raise ConfigError(
                flag,
                True,
                "async tensor parallel is done by inductor, so it needs compile.enable "
                "(with model in compile.components)",
                "add --compile.enable, or remove the flag",
            )
    if tp < 2:
        return
    args = MODELS[cfg.model.name].flavors[cfg.model.flavor]
    field = "parallelism.tensor_parallel_degree"
    sizes = {
        "n_heads": getattr(args, "n_heads", None),
        "n_kv_heads": getattr(args, "kv_heads", None),
        "hidden_dim": getattr(args, "hidden_dim", None),
    }
    shape = {k: v for k, v in sizes.items() if isinstance(v, int)}
    valid = [d for d in range(1, 65) if all(v % d == 0 for v in shape.values())]
    for name, size in shape.items():
        if size % tp != 0:
            shown = ", ".join(f"{k}={v}" for k, v in shape.items())
            raise ConfigError(
                field,
                tp,
                f"{cfg.model.name} {cfg.model.flavor} has {name}={size}, which tensor parallel "
                f"cannot split over {tp} ranks ({shown} must all be divisible by it)",
                f"use a tensor_parallel_degree among {', '.join(map(str, valid))}",
            )
    if cfg.training.seq_len % tp != 0:
        raise ConfigError(
            "training.seq_len",
            cfg.training.seq_len,
            f"sequence parallel splits the sequence over tensor_parallel_degree={tp} ranks, so "
            "it must be divisible by it",
            f"use a multiple of {tp}, e.g. {cfg.training.seq_len // tp * tp or tp}",
        )


def _validate_context_parallel(cfg: JobConfig, cp: int, tp: int) -> None:
    """The model supports CP, the sequence splits into 2 x cp chunks (and each rank's share
    over TP for sequence parallel), ring attention only on CUDA."""
    from torchtitan.models import MODELS

    if cp < 2:
        return
    field, p = "parallelism.context_parallel_degree", cfg.parallelism
    if not MODELS[cfg.model.name].supports_context_parallel:
        raise ConfigError(
            field,
            cp,
            f"model {cfg.model.name} does not support context parallel (its attention cannot "
            "be computed on a sharded sequence)",
            "set it to 1",
        )
    seq = cfg.training.seq_len
    step = math.lcm(2 * cp, cp * tp)
    if seq % step != 0:
        why = f"2 x cp = {2 * cp}" if tp == 1 else f"2 x cp = {2 * cp} and by cp x tp = {cp * tp}"
        raise ConfigError(
            "training.seq_len",
            seq,
            f"context parallel splits every sequence into 2 x {cp} load-balanced chunks (and "
            f"sequence parallel splits each rank's share over tp), so it must be divisible by {why}",
            f"use a multiple of {step}, e.g. {max(step, seq // step * step)}",
        )
    if p.context_parallel_method == "ring" and not torch.cuda.is_available():
        raise ConfigError(
            "parallelism.context_parallel_method",
            "ring",
            "torch's ring attention (torch.distributed.tensor.experimental.context_parallel) "
            "needs CUDA: torch 2.13 has no sharding rule for CPU scaled_dot_product_attention",
            "use --parallelism.context_parallel_method allgather (exact, any device)",
        )


def _validate_observability(cfg: JobConfig) -> None:
    """Metrics, memory monitor, profiling, validation and non-finite checks."""
    m, prof, val = cfg.metrics, cfg.profiling, cfg.validation
    _positive(cfg, "metrics.memory_warmup_steps", minimum=0)
    if m.memory_leak_window != 0 and m.memory_leak_window < 8:
        raise ConfigError(
            "metrics.memory_leak_window",
            m.memory_leak_window,
            "must be 0 (detector off) or at least 8 steps (the trend test compares quarters)",
            "use 20, or 0 to turn the leak detector off",
        )
    if not m.memory_leak_min_growth_mib > 0:
        raise ConfigError(
            "metrics.memory_leak_min_growth_mib",
            m.memory_leak_min_growth_mib,
            "must be > 0",
            "use e.g. 16 (MiB over one leak window)",
        )
    if prof.enable_profiling:
        _positive(cfg, "profiling.profile_freq")
        _positive(cfg, "profiling.profiler_warmup", minimum=0)
        _positive(cfg, "profiling.profiler_active")
        if prof.profiler_warmup + prof.profiler_active > prof.profile_freq:
            raise ConfigError(
                "profiling.profile_freq",
                prof.profile_freq,
                f"must hold profiler_warmup + profiler_active = "
                f"{prof.profiler_warmup} + {prof.profiler_active} steps",
                f"use profile_freq >= {prof.profiler_warmup + prof.profiler_active}, or fewer "
                "warm-up/active steps",
            )
    if prof.enable_memory_snapshot:
        if not torch.cuda.is_available():
            raise ConfigError(
                "profiling.enable_memory_snapshot",
                True,
                "CUDA memory snapshots need a CUDA device (the caching allocator records them); "
                "this machine has none. CPU profiler traces work: profiling.enable_profiling",
                "remove --profiling.enable_memory_snapshot, or run on a GPU",
            )
        _positive(cfg, "profiling.profile_freq")
    if val.enable:
        _positive(cfg, "validation.freq")
        if cfg.parallelism.pipeline_parallel_degree > 1:
            from torchtitan.distributed.pipeline_parallel import SCHEDULES, normalize_schedule_name

            name = normalize_schedule_name(cfg.parallelism.pipeline_parallel_schedule)
            if SCHEDULES[name].v_shaped:
                # torch 2.13: schedule.eval() on a V-shaped schedule still runs the backward
                # actions of the two stages that share a rank and fails ("can't steal_bwd_input
                # if this stage doesn't have backward").
                raise ConfigError(
                    "validation.enable",
                    True,
                    f"validation runs the pipeline forward-only (torch's schedule.eval), which "
                    f"torch 2.13 cannot do for the V-shaped schedule {name}",
                    "use a looped schedule (1F1B, Interleaved1F1B, InterleavedZeroBubble, ...) "
                    "with validation, or turn validation off",
                )
        if val.steps == 0 or val.steps < -1:
            raise ConfigError(
                "validation.steps",
                val.steps,
                "must be a number of batches >= 1, or -1 for the whole split",
                "use e.g. 10, or -1",
            )


def _validate_checkpoint(cfg: JobConfig, world_size: int) -> None:
    """Checkpoint options (checked even with checkpoint.enable off, so a typo fails early)."""
    ck = cfg.checkpoint
    if ck.create_seed_checkpoint:
        _validate_seed_checkpoint(cfg, world_size)
    if ck.export_dtype != "float32" and not ck.last_save_model_only:
        raise ConfigError(
            "checkpoint.export_dtype",
            ck.export_dtype,
            "applies only to the model-only checkpoint of checkpoint.last_save_model_only, "
            "which is off",
            "add --checkpoint.last_save_model_only, or drop export_dtype",
        )
    _positive(cfg, "checkpoint.interval")
    _positive(cfg, "checkpoint.keep_latest_k", minimum=0)
    if ck.load_step < -1:
        raise ConfigError(
            "checkpoint.load_step",
            ck.load_step,
            "must be -1 (the newest valid checkpoint) or a step >= 0",
            "use -1, or the N of an existing step-N folder",
        )
    if ck.folder.strip() in ("", "."):
        raise ConfigError(
            "checkpoint.folder",
            ck.folder,
            "must name a sub-folder of job.dump_folder (old checkpoints in it are deleted)",
            "use e.g. checkpoint",
        )
    from torchtitan.components.checkpoint import COMPONENTS

    unknown = sorted(set(ck.exclude_from_loading) - COMPONENTS)
    if unknown:
        raise ConfigError(
            "checkpoint.exclude_from_loading",
            ck.exclude_from_loading,
            f"{unknown} are not parts of a checkpoint",
            f"use some of {sorted(COMPONENTS)}",
        )
    if ck.initial_load_path and not Path(ck.initial_load_path).is_dir():
        raise ConfigError(
            "checkpoint.initial_load_path",
            ck.initial_load_path,
            "is not a folder",
            "give a step-N checkpoint folder, or a Hugging Face folder with initial_load_in_hf",
        )
    if ck.initial_load_in_hf:
        if not ck.initial_load_path:
            raise ConfigError(
                "checkpoint.initial_load_in_hf",
                True,
                "needs checkpoint.initial_load_path (the Hugging Face folder)",
                "set --checkpoint.initial_load_path",
            )
        from torchtitan.models import MODELS

        spec = MODELS.get(cfg.model.name)
        if spec is not None and spec.state_dict_adapter is None:
            raise ConfigError(
                "checkpoint.initial_load_in_hf",
                True,
                f"needs a Hugging Face weight converter (ModelSpec.state_dict_adapter), and "
                f"{cfg.model.name} has none",
                "convert the weights yourself and remove the flag",
            )
        if not list(Path(ck.initial_load_path).glob("*.safetensors")):
            raise ConfigError(
                "checkpoint.initial_load_path",
                ck.initial_load_path,
                "holds no *.safetensors files (initial_load_in_hf is set)",
                "point it at a Hugging Face model folder",
            )
    if ck.async_mode == "async_with_pinned_mem" and not torch.cuda.is_available():
        raise ConfigError(
            "checkpoint.async_mode",
            ck.async_mode,
            "pinned host memory needs CUDA, and this machine has no GPU",
            "use async (a background thread) or disabled",
        )


def _validate_seed_checkpoint(cfg: JobConfig, world_size: int) -> None:
    """A seed checkpoint is made by one process with every parallel degree 1, into an empty
    checkpoint folder (a newer checkpoint there would be resumed instead of the seed)."""
    from torchtitan.components.checkpoint_io import complete_steps

    ck, p = cfg.checkpoint, cfg.parallelism
    if not ck.enable:
        raise ConfigError(
            "checkpoint.create_seed_checkpoint",
            True,
            "writes into the checkpoint folder, and checkpoint.enable is off",
            "add --checkpoint.enable",
        )
    if world_size != 1:
        raise ConfigError(
            "checkpoint.create_seed_checkpoint",
            True,
            f"runs on one process, and this launch has {world_size} (WORLD_SIZE)",
            "make the seed with NGPU=1 (or plain python), then start the parallel run",
        )
    for name in (
        "data_parallel_replicate_degree",
        "data_parallel_shard_degree",
        "tensor_parallel_degree",
        "pipeline_parallel_degree",
        "context_parallel_degree",
    ):
        value = getattr(p, name)
        if value != 1 and not (name == "data_parallel_shard_degree" and value == -1):
            raise ConfigError(
                f"parallelism.{name}",
                value,
                "must be 1 with checkpoint.create_seed_checkpoint (the seed is made on one "
                "process, every parallel degree 1; the run that loads it may use any)",
                f"set --parallelism.{name} 1 for the seed run",
            )
    root = Path(cfg.job.dump_folder) / ck.folder
    if complete_steps(root):
        raise ConfigError(
            "checkpoint.create_seed_checkpoint",
            True,
            f"{root} already holds checkpoints (steps {complete_steps(root)}), which a run "
            "would resume from instead of the seed",
            "use a fresh job.dump_folder or checkpoint.folder",
        )
