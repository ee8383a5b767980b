"""Cross-field checks, run before any process group or model exists.

Each failure is a ConfigError naming the field, the value, the rule and a fix.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from torchtitan.config.errors import ConfigError, require_int
from torchtitan.config.job_config import JobConfig
from torchtitan.config.validate_features import (
    validate_checkpoint,
    validate_observability,
    validate_speed_features,
)
from torchtitan.config.validate_parallel import validate_context_parallel, validate_tensor_parallel
from torchtitan.distributed.utils import device_type
from torchtitan.tools.logging import logger

if TYPE_CHECKING:
    from torchtitan.distributed.pipeline_parallel import PipelinePlan


def world_size_from_env() -> int:
    """The world size torchrun will give us (1 when launched without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def pipeline_plan(cfg: JobConfig) -> PipelinePlan | None:
    """The stages and microbatches the config asks for (None without PP); ConfigError if invalid."""
    from torchtitan.distributed.pipeline_parallel import (
        SCHEDULES,
        normalize_schedule_name,
        plan_from_config,
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
    plan = plan_from_config(p, args.n_layers, cfg.training.local_batch_size)
    assert plan is not None
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

    validate_speed_features(cfg)
    validate_observability(cfg)
    validate_checkpoint(cfg, world_size)

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
        require_int(cfg, f)
    require_int(cfg, "training.gc_freq", minimum=0)
    require_int(cfg, "lr_scheduler.warmup_steps", minimum=0)
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
    validate_tensor_parallel(cfg, dims.tp)
    validate_context_parallel(cfg, dims.cp, dims.tp)

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
    if t.mixed_precision_param == "bfloat16" and device_type() != "cuda":
        logger.warning(
            "training.mixed_precision_param = 'bfloat16' on a machine without CUDA: it works, "
            "but bf16 matmuls are far slower than fp32 on most CPUs (use 'auto' or 'float32')"
        )
