"""Cross-field checks, run before any process group or model exists.

Each failure is a ConfigError naming the field, the value, the rule and a fix. ``load_config``
(parse, then validate) is what entry points call; ``torchtitan.config.parse_args`` only parses.
"""

from __future__ import annotations

import os

from torchtitan.config.errors import ConfigError, require_int
from torchtitan.config.job_config import JobConfig
from torchtitan.config.manager import parse_args
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.pipeline_stages import (
    SCHEDULES,
    PipelineStages,
    normalize_schedule_name,
    plan_from_config,
)
from torchtitan.distributed.utils import device_type
from torchtitan.models import MODELS, flavor_args, flavor_of
from torchtitan.preflight.validate_data import validate_data
from torchtitan.preflight.validate_eval import validate_eval
from torchtitan.preflight.validate_features import (
    validate_attention,
    validate_checkpoint,
    validate_observability,
    validate_speed_features,
)
from torchtitan.preflight.validate_lora import validate_lora
from torchtitan.preflight.validate_memory import validate_memory_levers
from torchtitan.preflight.validate_moe import validate_expert_parallel
from torchtitan.preflight.validate_optim import validate_optimizer
from torchtitan.preflight.validate_parallel import (
    validate_context_parallel,
    validate_tensor_parallel,
)
from torchtitan.preflight.validate_paths import validate_paths
from torchtitan.preflight.validate_posttrain import validate_mode_fields, validate_posttrain
from torchtitan.preflight.validate_resilience import (
    check_lighthouse,
    validate_fault_tolerance,
    validate_resilience,
)
from torchtitan.preflight.validate_samples import validate_chat, validate_vlm
from torchtitan.preflight.validate_values import validate_values
from torchtitan.tools.logging import logger


def world_size_from_env() -> int:
    """The world size torchrun will give us (1 when launched without torchrun)."""
    return parse_world_size(os.environ.get("WORLD_SIZE", "1"), "$WORLD_SIZE")


def parse_world_size(raw: str, where: str = "--world_size") -> int:
    """A world size as written (``--world_size N`` or ``$WORLD_SIZE``): an integer >= 1."""
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ConfigError(
            where, raw, "must be an integer >= 1 (the number of ranks)", f"use e.g. {where} 8"
        )
    return n


def load_config(argv: list[str] | None = None, world_size: int | None = None) -> JobConfig:
    """Parse ``argv`` and validate the result for ``world_size`` ranks (default: $WORLD_SIZE)."""
    cfg = parse_args(argv)
    validate_config(cfg, world_size)
    return cfg


def pipeline_stages(cfg: JobConfig) -> PipelineStages | None:
    """The stages and microbatches the config asks for (None without PP); ConfigError if invalid.
    The trainer, explain, the estimator and the planner all take the plan from here."""
    p = cfg.parallelism
    normalize_schedule_name(p.pipeline_parallel_schedule)  # a typo fails even without PP
    if p.pipeline_parallel_degree <= 1:
        return None
    spec = MODELS[cfg.model.name]
    model_plan = spec.parallel_plan(flavor_args(cfg))
    refused = model_plan.refusals.get("pipeline_parallel")
    if refused:
        raise ConfigError(
            "parallelism.pipeline_parallel_degree",
            p.pipeline_parallel_degree,
            f"model {cfg.model.name} cannot be split into pipeline stages: {refused}",
            "set it to 1",
        )
    if model_plan.tied_embeddings:
        raise ConfigError(
            "parallelism.pipeline_parallel_degree",
            p.pipeline_parallel_degree,
            f"{cfg.model.flavor} ties the embedding and output weights, which pipeline parallel "
            "puts on different stages",
            "use a flavor with untied embeddings, or pipeline_parallel_degree 1",
        )
    plan = plan_from_config(p, model_plan.unit_names, cfg.training.local_batch_size)
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
    world_size = world_size_from_env() if world_size is None else world_size
    if world_size < 1:
        parse_world_size(str(world_size), "world_size")  # raises: no ranks
    validate_values(cfg)  # every number finite and in range, every choice valid
    validate_mode_fields(cfg)  # [dpo]/[grpo]/LM data fields the mode would ignore
    validate_speed_features(cfg)
    validate_observability(cfg)
    validate_checkpoint(cfg, world_size)
    validate_resilience(cfg)
    validate_fault_tolerance(cfg)  # replica groups with torchft (docs/fault_tolerance.md)
    _validate_model(cfg)
    _validate_training(cfg)
    validate_data(cfg)  # tokenized corpora and mixtures (docs/data.md)
    validate_chat(cfg)  # chat SFT data (docs/sft.md)
    validate_vlm(cfg)  # image-text data (docs/vlm.md)

    p = cfg.parallelism
    dims = ParallelDims.from_config(p, world_size)
    pipeline_stages(cfg)  # split, schedule and microbatch checks (no-op without PP)
    validate_tensor_parallel(cfg, dims.tp)
    validate_context_parallel(cfg, dims.cp, dims.tp)
    validate_attention(cfg, dims.cp)
    validate_expert_parallel(cfg, dims)
    validate_lora(cfg, dims)  # adapters (docs/lora.md)
    dims.batch_sizes(cfg.training.local_batch_size, cfg.training.global_batch_size)
    validate_memory_levers(cfg, world_size)
    validate_optimizer(cfg)  # parameter groups and Muon (docs/optimizers.md)
    validate_paths(cfg)  # dump folder, tokenizer, data files, checkpoint step (touch the disk)
    validate_posttrain(cfg, dims)  # training.mode, [dpo], [grpo] and their data (docs/posttrain.md)
    validate_eval(cfg)  # [eval]: tasks known, local files present, offline-readable
    check_lighthouse(cfg)  # torchft's lighthouse answers (a network check)

    if cfg.training.mixed_precision_param == "bfloat16" and device_type() != "cuda":
        logger.warning(
            "training.mixed_precision_param = 'bfloat16' on a machine without CUDA: it works, "
            "but bf16 matmuls are far slower than fp32 on most CPUs (use 'auto' or 'float32')"
        )


def _validate_model(cfg: JobConfig) -> None:
    if cfg.model.name not in MODELS:
        raise ConfigError(
            "model.name", cfg.model.name, f"must be one of {list(MODELS)}", "pick a known model"
        )
    spec = MODELS[cfg.model.name]
    if cfg.model.hf_trust_remote_code and not hasattr(spec, "flavor_key"):
        raise ConfigError(
            "model.hf_trust_remote_code",
            True,
            f"only the hf family builds remote code, and model.name is {cfg.model.name}",
            "turn it off, or use model.name hf",
        )
    if flavor_of(cfg) not in spec.flavors:
        raise ConfigError(
            "model.flavor",
            cfg.model.flavor,
            f"is not a flavor of {cfg.model.name}",
            f"pick one of {list(spec.flavors)}",
        )
    # model.tokenizer_path: validate_paths loads it (from the repository root too) and decodes.


def _validate_training(cfg: JobConfig) -> None:
    for f in (
        "training.steps",
        "training.seq_len",
        "training.local_batch_size",
        "metrics.log_freq",
    ):
        require_int(cfg, f)
    require_int(cfg, "training.gc_freq", minimum=0)
    require_int(cfg, "lr_scheduler.warmup_steps", minimum=0)
    s = cfg.lr_scheduler
    for name, value, fix in (
        ("decay_ratio", s.decay_ratio, "use 1.0 for decay over all post-warm-up steps"),
        ("min_lr_factor", s.min_lr_factor, "use e.g. 0.1"),
        ("warmup_start_factor", s.warmup_start_factor, "use 0.0"),
    ):
        if not 0.0 <= value <= 1.0:
            raise ConfigError(f"lr_scheduler.{name}", value, "must be in [0, 1]", fix)
    if cfg.optimizer.lr <= 0:
        raise ConfigError("optimizer.lr", cfg.optimizer.lr, "must be > 0", "use e.g. 3e-4")
