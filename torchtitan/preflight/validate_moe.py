"""Config checks for expert parallel and multi-token prediction (part of ``validate_config``;
docs/parallelisms.md, docs/deepseek_v3.md)."""

from __future__ import annotations

from typing import Any

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.float8 import float8_unsupported_reason
from torchtitan.distributed.parallel_dims import ParallelDims, divisors
from torchtitan.distributed.utils import device_type
from torchtitan.models import flavor_args

_FIELD = "parallelism.expert_parallel_degree"


def validate_expert_parallel(cfg: JobConfig, dims: ParallelDims) -> None:
    """The MoE overrides need an MoE flavor; EP needs one whose expert count it divides, and
    borrows its ranks from dp_shard x cp (which it must divide). EP composes with FSDP, HSDP,
    TP, PP and CP (docs/parallelisms.md, "Expert parallel")."""
    moe = getattr(flavor_args(cfg), "moe", None)
    for name in ("moe_aux_loss_coef", "moe_bias_update_rate", "moe_num_experts"):
        value = getattr(cfg.model, name)
        if value != -1.0 and (value < 0 or moe is None):
            rule = "must be >= 0 (or -1: the flavor's)" if value < 0 else "needs an MoE flavor"
            raise ConfigError(f"model.{name}", value, rule, "remove it, or pick an MoE flavor")
    validate_mtp(cfg, dims)
    validate_float8_experts(cfg, moe)
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
    borrowed = dims.dp_shard * dims.cp
    if borrowed % ep != 0:
        source = f"data_parallel_shard_degree={dims.dp_shard}"
        if dims.cp > 1:
            source += f" x context_parallel_degree={dims.cp} (= {borrowed})"
        raise ConfigError(
            _FIELD,
            ep,
            f"borrows its ranks from {source}, which it must divide",
            f"use one of {', '.join(map(str, divisors(borrowed)))}",
        )
    if moe.num_experts % ep != 0:
        options = [d for d in divisors(moe.num_experts) if borrowed % d == 0]
        raise ConfigError(
            _FIELD,
            ep,
            f"must divide the {moe.num_experts} experts of each MoE layer",
            f"use one of {', '.join(map(str, options))}",
        )


def validate_mtp(cfg: JobConfig, dims: ParallelDims) -> None:
    """The multi-token-prediction overrides need a family with MTP (deepseek_v3). MTP runs under
    pipeline parallel (on the last stage) and under context parallel's ``allgather`` method; its
    shifted tokens are not passed through ``ring`` attention's in-place sharding, and the chunked
    loss, which defers the output head, has no MTP losses (both refused; docs/deepseek_v3.md)."""
    args = flavor_args(cfg)
    has_mtp = hasattr(args, "mtp_depth")
    for name in ("mtp_depth", "mtp_loss_weight"):
        value = getattr(cfg.model, name)
        if value != -1 and not has_mtp:
            raise ConfigError(
                f"model.{name}",
                value,
                f"{cfg.model.name} has no multi-token prediction",
                "remove it, or use --model.name deepseek_v3",
            )
    depth = cfg.model.mtp_depth if cfg.model.mtp_depth >= 0 else getattr(args, "mtp_depth", 0)
    seq_len = cfg.training.seq_len
    if depth > max(seq_len - 2, 0):
        # module k predicts the token k + 1 ahead: module D has a target only at positions
        # below seq_len - D - 1 (and past seq_len its shifted tokens no longer line up)
        raise ConfigError(
            "model.mtp_depth",
            depth,
            f"must be at most training.seq_len - 2 = {seq_len - 2}: MTP module k predicts the "
            f"token k + 1 ahead, so module {depth} needs sequences of at least {depth + 2} tokens",
            "use 1 (DeepSeek-V3's), or 0 to turn multi-token prediction off",
        )
    if depth > 0 and cfg.training.loss_chunk_size > 0:
        # the chunked loss defers the output head: the MTP modules would get hidden states
        raise ConfigError(
            "training.loss_chunk_size",
            cfg.training.loss_chunk_size,
            "the chunked loss does not take the multi-token-prediction losses",
            "set --training.loss_chunk_size 0 (or --model.mtp_depth 0)",
        )
    method = cfg.parallelism.context_parallel_method
    if depth > 0 and dims.cp > 1 and method == "ring":
        raise ConfigError(
            "parallelism.context_parallel_method",
            method,
            "multi-token prediction under context parallel runs with the allgather method",
            "use --parallelism.context_parallel_method allgather (or --model.mtp_depth 0)",
        )


_F8 = "quantize.moe.float8.enable"


def validate_float8_experts(cfg: JobConfig, moe: Any) -> None:
    """Float8 experts need an MoE flavor, widths the float8 GEMM takes (multiples of 16), a
    device with float8 tensor cores (CUDA capability >= 8.9) unless emulated, and a
    high-precision LoRA base (docs/float8.md, "Float8 experts")."""
    f8 = cfg.quantize.moe.float8
    if not f8.enable:
        if f8.emulate:
            raise ConfigError(
                "quantize.moe.float8.emulate", True, f"only applies with {_F8}", f"add --{_F8}"
            )
        return
    if moe is None:
        raise ConfigError(
            _F8,
            True,
            f"{cfg.model.name} {cfg.model.flavor} has no routed experts",
            f"remove --{_F8}, or pick an MoE flavor (e.g. qwen3 debugmodel_moe)",
        )
    dim = flavor_args(cfg).dim
    if dim % 16 or moe.expert_dim % 16:
        raise ConfigError(
            _F8,
            True,
            f"the float8 grouped GEMM needs widths that are multiples of 16; the experts are "
            f"{dim} x {moe.expert_dim}",
            f"remove --{_F8}",
        )
    if cfg.lora.enable and cfg.lora.quantize_base != "none":
        raise ConfigError(
            _F8,
            True,
            f"the experts cannot be both float8 and a {cfg.lora.quantize_base} base",
            f"remove --{_F8} or --lora.quantize_base",
        )
    reason = float8_unsupported_reason(device_type(), emulate=f8.emulate)
    if reason is not None:
        raise ConfigError(
            _F8,
            True,
            f"float8 experts cannot run here: {reason}",
            f"remove --{_F8}, or add --quantize.moe.float8.emulate to check the numerics "
            "without float8 hardware (no speed-up)",
        )
