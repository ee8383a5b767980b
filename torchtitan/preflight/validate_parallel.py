"""Config checks for tensor and context parallel (part of ``validate_config``)."""

from __future__ import annotations

import math

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.tensor_parallel import tp_problem
from torchtitan.distributed.utils import device_type
from torchtitan.models import MODELS, flavor_args
from torchtitan.tools.torch_compat import pipeline_dtensor_unsupported_reason


def validate_tensor_parallel(cfg: JobConfig, tp: int) -> None:
    """Head counts, sequence length and widths divisible by TP; async TP's requirements."""
    p = cfg.parallelism
    if p.enable_async_tensor_parallel:
        flag, fix = "parallelism.enable_async_tensor_parallel", "remove the flag"
        if device_type() != "cuda":
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
    old_torch = p.pipeline_parallel_degree > 1 and pipeline_dtensor_unsupported_reason()
    if old_torch:
        fix = "use tensor_parallel_degree 1 or pipeline_parallel_degree 1 with this torch"
        raise ConfigError("parallelism.tensor_parallel_degree", tp, old_torch, fix)
    spec = MODELS[cfg.model.name]
    model_plan = spec.parallel_plan(flavor_args(cfg))
    refused = model_plan.refusals.get("tensor_parallel")
    if refused:
        reason = f"model {cfg.model.name} cannot take tensor parallel: {refused}"
        raise ConfigError("parallelism.tensor_parallel_degree", tp, reason, "set it to 1")
    divisible = model_plan.tensor_parallel.divisible
    problem = tp_problem(divisible, tp)
    if problem is not None:
        valid = [d for d in range(1, 65) if tp_problem(divisible, d) is None]
        raise ConfigError(
            "parallelism.tensor_parallel_degree",
            tp,
            f"{cfg.model.name} {cfg.model.flavor} has {problem}",
            f"use a tensor_parallel_degree among {', '.join(map(str, valid))}",
        )
    if tp_problem({}, tp, cfg.training.seq_len) is not None:
        raise ConfigError(
            "training.seq_len",
            cfg.training.seq_len,
            f"sequence parallel splits the sequence over tensor_parallel_degree={tp} ranks, so "
            "it must be divisible by it",
            f"use a multiple of {tp}, e.g. {cfg.training.seq_len // tp * tp or tp}",
        )


def validate_context_parallel(cfg: JobConfig, cp: int, tp: int) -> None:
    """The model supports CP, the sequence splits into 2 x cp chunks (and each rank's share
    over TP for sequence parallel), ring attention only on CUDA."""
    p = cfg.parallelism
    if p.context_parallel_rotate_method != "allgather" and p.context_parallel_method != "ring":
        raise ConfigError(
            "parallelism.context_parallel_rotate_method",
            p.context_parallel_rotate_method,
            "only ring attention rotates K/V shards, and context_parallel_method is "
            f"{p.context_parallel_method!r}",
            "drop it, or add --parallelism.context_parallel_method ring (CUDA)",
        )
    if cp < 2:
        return
    field = "parallelism.context_parallel_degree"
    spec = MODELS[cfg.model.name]
    model_plan = spec.parallel_plan(flavor_args(cfg))
    if model_plan.context_parallel is None:
        why = model_plan.refusals.get(
            "context_parallel", "its attention cannot be computed on a sharded sequence"
        )
        reason = f"model {cfg.model.name} does not support context parallel ({why})"
        fix = (
            "set it to 1; for long sequences split the heads with tensor parallel and "
            "checkpoint activations instead"
        )
        raise ConfigError(field, cp, reason, fix)
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
    # block_causal rings run our document ring (distributed/context_parallel/ring.py), on any device.
    block = cfg.model.attn_mask_type == "block_causal"
    if (
        p.context_parallel_method == "ring"
        and not block
        and not model_plan.context_parallel.torch_ring
    ):
        raise ConfigError(
            "parallelism.context_parallel_method",
            "ring",
            f"model {cfg.model.name} has layers outside attention that read the whole sequence "
            "(linear attention), and torch's causal ring attention patches only SDPA",
            "use --parallelism.context_parallel_method allgather",
        )
    if p.context_parallel_method == "ring" and device_type() != "cuda" and not block:
        raise ConfigError(
            "parallelism.context_parallel_method",
            "ring",
            "torch's ring attention (torch.distributed.tensor.experimental.context_parallel) "
            "needs CUDA: torch 2.13 has no sharding rule for CPU scaled_dot_product_attention",
            "use --parallelism.context_parallel_method allgather (exact, any device)",
        )
