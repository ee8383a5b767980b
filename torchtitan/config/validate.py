"""Cross-field checks, run before any process group or model exists.

Each failure is a ConfigError naming the field, the value, the rule and a fix.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig
from torchtitan.tools.logging import logger

# Fields whose feature is built by a later issue: using them is an error that says so.
_NOT_YET: list[tuple[str, str]] = [
    ("checkpoint.enable", "checkpointing"),
    ("compile.enable", "torch.compile"),
    ("quantize.dense.float8.enable", "float8 training"),
    ("profiling.enable_profiling", "profiling"),
    ("profiling.enable_memory_snapshot", "memory snapshots"),
    ("validation.enable", "validation"),
]


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


def validate_config(cfg: JobConfig, world_size: int | None = None) -> None:
    """Raise ConfigError on the first rule the config breaks."""
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.models import MODELS

    world_size = world_size_from_env() if world_size is None else world_size
    t, p = cfg.training, cfg.parallelism

    for dotted, feature in _NOT_YET:
        if _get(cfg, dotted):
            raise ConfigError(dotted, True, f"{feature} is not available yet", f"remove --{dotted}")
    if cfg.activation_checkpoint.mode != "none":
        raise ConfigError(
            "activation_checkpoint.mode",
            cfg.activation_checkpoint.mode,
            "activation checkpointing is not available yet",
            'use mode = "none"',
        )

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
    dims = ParallelDims(
        dp_replicate=p.data_parallel_replicate_degree,
        dp_shard=p.data_parallel_shard_degree,
        cp=p.context_parallel_degree,
        tp=p.tensor_parallel_degree,
        pp=p.pipeline_parallel_degree,
        world_size=world_size,
    )
    if dims.pp_enabled:
        raise ConfigError(
            "parallelism.pipeline_parallel_degree",
            dims.pp,
            "pipeline parallel is not available yet",
            "set it to 1",
        )
    if dims.cp_enabled:
        raise ConfigError(
            "parallelism.context_parallel_degree",
            dims.cp,
            "context parallel is not available yet",
            "set it to 1",
        )
    if dims.tp_enabled:
        raise ConfigError(
            "parallelism.tensor_parallel_degree",
            dims.tp,
            "tensor parallel is not available yet",
            "set it to 1",
        )
    if p.enable_async_tensor_parallel:
        raise ConfigError(
            "parallelism.enable_async_tensor_parallel",
            True,
            "async tensor parallel is not available yet",
            "remove the flag",
        )

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
