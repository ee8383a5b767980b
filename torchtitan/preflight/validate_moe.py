"""Config checks for expert parallel (part of ``validate_config``; docs/parallelisms.md)."""

from __future__ import annotations

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims, divisors
from torchtitan.models import MODELS

_FIELD = "parallelism.expert_parallel_degree"


def validate_expert_parallel(cfg: JobConfig, dims: ParallelDims) -> None:
    """The MoE overrides need an MoE flavor; EP needs one whose expert count it divides, and
    borrows its ranks from dp_shard (which it must divide); layouts not built yet are refused."""
    moe = getattr(MODELS[cfg.model.name].flavors[cfg.model.flavor], "moe", None)
    for name in ("moe_aux_loss_coef", "moe_bias_update_rate"):
        value = getattr(cfg.model, name)
        if value != -1.0 and (value < 0 or moe is None):
            rule = "must be >= 0 (or -1: the flavor's)" if value < 0 else "needs an MoE flavor"
            raise ConfigError(f"model.{name}", value, rule, "remove it, or pick an MoE flavor")
    ep = cfg.parallelism.expert_parallel_degree
    if ep < 1:
        raise ConfigError(
            _FIELD, ep, "must be an integer >= 1", "use 1 (off) or a divisor of dp_shard"
        )
    if ep == 1:
        return
    if moe is None:
        raise ConfigError(
            _FIELD,
            ep,
            f"{cfg.model.name} {cfg.model.flavor} has no experts to split",
            "use 1, or an MoE flavor (e.g. qwen3 debugmodel_moe)",
        )
    if dims.dp_shard % ep != 0:
        raise ConfigError(
            _FIELD,
            ep,
            f"borrows its ranks from data_parallel_shard_degree={dims.dp_shard}, which it must divide",
            f"use one of {', '.join(map(str, divisors(dims.dp_shard)))}",
        )
    if moe.num_experts % ep != 0:
        raise ConfigError(
            _FIELD,
            ep,
            f"must divide the {moe.num_experts} experts of each MoE layer",
            f"use one of {', '.join(str(d) for d in divisors(moe.num_experts) if dims.dp_shard % d == 0)}",
        )
    unsupported = {
        "data_parallel_replicate_degree": dims.dp_replicate,
        "context_parallel_degree": dims.cp,
    }
    for name, degree in unsupported.items():
        if degree > 1:
            raise ConfigError(
                f"parallelism.{name}",
                degree,
                "expert parallel is built with FSDP, TP and PP only (not yet with HSDP or CP)",
                f"set {name} = 1 or expert_parallel_degree = 1",
            )
