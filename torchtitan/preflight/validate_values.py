"""Per-field value rules: every number of the config is finite and in its range, every choice
is one of its options (part of ``validate_config``, run before the cross-field checks).

``RULES`` maps a dotted field to its rule. ``tests/unit/test_validate_values.py`` walks every
field of ``JobConfig`` and fails when a numeric field has no rule here, so a new ``int`` or
``float`` field must get one line below (docs/errors.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, get_args, get_origin

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig
from torchtitan.config.manager import iter_fields


@dataclass(frozen=True)
class Num:
    """A finite number (``integer``: a whole one) in ``[low, high]``; ``low_open``/``high_open``
    exclude the bound; ``special`` values (e.g. -1 for "auto", 0 for "off") are also accepted;
    ``fix`` is the advice shown with the error."""

    low: float | None = None
    high: float | None = None
    integer: bool = False
    low_open: bool = False
    high_open: bool = False
    special: tuple[float, ...] = ()
    fix: str = ""

    def problem(self, value: Any) -> str | None:
        """The rule ``value`` breaks, as a phrase, or None."""
        kind = "an integer" if self.integer else "a number"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"must be {kind}"
        if self.integer and not isinstance(value, int):
            return f"must be {kind}"
        if value in self.special:
            return None
        if not math.isfinite(value):
            bounds = self.describe()
            return "must be a finite number" + (
                "" if bounds == "any finite value" else f" {bounds}"
            )
        too_low = self.low is not None and (
            value <= self.low if self.low_open else value < self.low
        )
        too_high = self.high is not None and (
            value >= self.high if self.high_open else value > self.high
        )
        return f"must be {self.describe()}" if too_low or too_high else None

    def describe(self) -> str:
        if self.low is not None and self.high is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            text = f"in {left}{_fmt(self.low)}, {_fmt(self.high)}{right}"
        elif self.low is not None:
            text = f"{'>' if self.low_open else '>='} {_fmt(self.low)}"
        elif self.high is not None:
            text = f"{'<' if self.high_open else '<='} {_fmt(self.high)}"
        else:
            text = "any finite value"
        if self.special:
            text += " or " + " or ".join(_fmt(s) for s in self.special)
        return text


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


def count(low: int = 1, fix: str = "", special: tuple[float, ...] = ()) -> Num:
    """An integer >= ``low`` (plus the ``special`` values)."""
    return Num(low=low, integer=True, special=special, fix=fix)


def fraction(fix: str, high_open: bool = False) -> Num:
    """A number in [0, 1] (or [0, 1))."""
    return Num(low=0.0, high=1.0, high_open=high_open, fix=fix)


AUTO = (-1,)  # -1 means "derive it" for several degrees and sizes

RULES: dict[str, Num] = {
    # lora (docs/lora.md)
    "lora.rank": count(fix="use e.g. 8 or 16"),
    "lora.alpha": Num(low=0.0, low_open=True, fix="use e.g. 16 (twice the rank)"),
    "lora.dropout": fraction(fix="use 0 or e.g. 0.05", high_open=True),
    # training
    "training.local_batch_size": count(fix="use e.g. 8"),
    "training.global_batch_size": count(
        special=AUTO, fix="use -1 (local_batch_size x dp degree) or a multiple of it"
    ),
    "training.seq_len": count(fix="use e.g. 2048"),
    "training.image_tokens_per_sample": count(
        low=0, fix="give the data's mean merged image tokens per sample, or 0"
    ),
    "training.loss_chunk_size": count(low=0, fix="use 0 (whole logits) or e.g. 1024 tokens"),
    "training.max_norm": Num(fix="use e.g. 1.0, or 0 to turn clipping off"),
    "training.steps": count(fix="use e.g. 1000"),
    "training.gc_freq": count(0, fix="use e.g. 50, or 0 for Python's automatic GC"),
    # model (MoE overrides, docs/moe.md)
    "model.n_layers": count(special=AUTO, fix="use e.g. 4, or -1 (the flavor's depth)"),
    "model.moe_num_experts": count(special=AUTO, fix="use e.g. 16, or -1 (the flavor's)"),
    "model.moe_aux_loss_coef": Num(low=0.0, special=AUTO, fix="use 0 (off), e.g. 0.001, or -1"),
    "model.moe_bias_update_rate": Num(low=0.0, special=AUTO, fix="use 0 (off), e.g. 0.001, or -1"),
    "model.mtp_depth": count(low=0, special=AUTO, fix="use 0 (off), 1, or -1 (the flavor's)"),
    # the MTP losses are auxiliary to the next-token loss: a weight above 1 lets them dominate
    # it (DeepSeek-V3 trains with 0.3, then 0.1; docs/deepseek_v3.md)
    "model.mtp_loss_weight": Num(
        low=0.0, high=1.0, special=AUTO, fix="use e.g. 0.3 (DeepSeek-V3's), or -1 (the flavor's)"
    ),
    # parallelism
    "parallelism.data_parallel_replicate_degree": count(fix="use 1 (no replication) or more"),
    "parallelism.data_parallel_shard_degree": count(special=AUTO, fix="use -1 (every rank left)"),
    "parallelism.tensor_parallel_degree": count(fix="use 1 (off) or a divisor of the heads"),
    "parallelism.pipeline_parallel_degree": count(fix="use 1 (off) or the number of stages"),
    "parallelism.pipeline_parallel_microbatches": count(
        special=AUTO, fix="use -1 (one per stage) or a divisor of training.local_batch_size"
    ),
    "parallelism.pipeline_parallel_microbatch_size": count(
        special=AUTO, fix="use -1, or a divisor of training.local_batch_size"
    ),
    "parallelism.pipeline_parallel_layers_per_stage": count(special=AUTO, fix="use -1"),
    "parallelism.context_parallel_degree": count(fix="use 1 (off) or more"),
    "parallelism.expert_parallel_degree": count(fix="use 1 (off) or a divisor of the experts"),
    # optimizer
    "optimizer.lr": Num(low=0.0, high=1.0, low_open=True, fix="use e.g. 3e-4"),
    "optimizer.beta1": fraction("use e.g. 0.9", high_open=True),
    "optimizer.beta2": fraction("use e.g. 0.95", high_open=True),
    "optimizer.eps": Num(low=0.0, high=1.0, low_open=True, fix="use e.g. 1e-8"),
    "optimizer.weight_decay": Num(low=0.0, fix="use e.g. 0.1, or 0 for none"),
    "optimizer.muon_momentum": fraction("use e.g. 0.95", high_open=True),
    "optimizer.muon_ns_steps": Num(low=1, high=99, integer=True, fix="use e.g. 5"),
    # lr_scheduler
    "lr_scheduler.warmup_steps": count(0, fix="use e.g. 200, or 0 for no warm-up"),
    "lr_scheduler.warmup_start_factor": fraction("use 0.0"),
    "lr_scheduler.decay_ratio": fraction("use 1.0 for decay over all post-warm-up steps"),
    "lr_scheduler.min_lr_factor": fraction("use e.g. 0.1"),
    # checkpoint
    "checkpoint.interval": count(fix="use e.g. 500"),
    "checkpoint.keep_latest_k": count(0, fix="use e.g. 10, or 0 to keep all"),
    "checkpoint.load_step": count(
        0, special=AUTO, fix="use -1 (the newest valid checkpoint), or the N of a step-N folder"
    ),
    # metrics
    "metrics.log_freq": count(fix="use e.g. 10"),
    "metrics.memory_warmup_steps": count(0, fix="use e.g. 3"),
    "metrics.memory_leak_window": count(8, special=(0,), fix="use 20, or 0 to turn it off"),
    "metrics.memory_leak_min_growth_mib": Num(low=0.0, low_open=True, fix="use e.g. 16"),
    # profiling
    "profiling.profile_freq": count(fix="use e.g. 100"),
    "profiling.profiler_warmup": count(0, fix="use e.g. 3"),
    "profiling.profiler_active": count(fix="use e.g. 1"),
    # comm
    "comm.init_timeout_seconds": count(fix="use e.g. 300"),
    "comm.train_timeout_seconds": count(fix="use e.g. 100"),
    # validation
    "validation.freq": count(fix="use e.g. 500"),
    "validation.steps": count(special=AUTO, fix="use e.g. 10, or -1 for the whole split"),
    # eval (tasks and layouts: preflight/validate_eval.py)
    "eval.freq": count(0, fix="use e.g. 500, or 0 for off"),
    "eval.limit": count(1, special=AUTO, fix="use e.g. 100, or -1 for every document"),
    "eval.num_fewshot": count(0, special=AUTO, fix="use e.g. 5, or -1 for the task's own"),
    "eval.batch_size": count(fix="use e.g. 8"),
    "eval.max_gen_tokens": count(fix="use e.g. 256"),
    # debug
    "debug.seed": Num(low=0, high=2**63 - 1, integer=True, fix="use e.g. 0"),
    # spikes and fault tolerance (cross-field checks: preflight/validate_resilience.py)
    "training.spike_window": count(3, fix="use e.g. 50"),
    "training.spike_threshold": Num(low=0.0, low_open=True, fix="use e.g. 6.0"),
    "training.spike_warmup": count(0, fix="use e.g. 20"),
    "training.max_consecutive_skips": count(0, fix="use e.g. 10, or 0 to never abort"),
    "fault_tolerance.watchdog_timeout_seconds": Num(low=0.0, fix="use e.g. 60, or 0 for off"),
    "fault_tolerance.straggler_margin": Num(low=0.0, fix="use e.g. 0.5, or 0 for off"),
    "fault_tolerance.straggler_log_steps": count(fix="use e.g. 3"),
    # replica groups with torchft (docs/fault_tolerance.md); the cross-field rules (replica_id
    # below group_size, at least 2 groups, sync_every >= 1 with its reason) in validate_resilience
    "fault_tolerance.replica_id": count(0, fix="use 0..group_size-1"),
    "fault_tolerance.group_size": count(0, fix="use the number of replica-group jobs (>= 2)"),
    "fault_tolerance.min_replicas": count(fix="use e.g. 1"),
    "fault_tolerance.quorum_timeout_seconds": Num(low=0.0, low_open=True, fix="use e.g. 60"),
    "fault_tolerance.connect_timeout_seconds": Num(low=0.0, low_open=True, fix="use e.g. 10"),
    "fault_tolerance.timeout_seconds": Num(low=0.0, low_open=True, fix="use e.g. 60"),
    "fault_tolerance.quorum_retries": count(0, fix="use e.g. 3"),
    "fault_tolerance.sync_every": Num(integer=True, fix="use e.g. 10 (steps between syncs)"),
    "fault_tolerance.outer_lr": Num(low=0.0, low_open=True, fix="use e.g. 0.7 (DiLoCo's)"),
    "fault_tolerance.outer_momentum": fraction(fix="use e.g. 0.9", high_open=True),
    # post-training (docs/posttrain.md); k = 1 is refused with its reason in validate_posttrain
    "dpo.beta": Num(low=0.0, low_open=True, fix="use e.g. 0.1"),
    "dpo.label_smoothing": Num(low=0.0, high=0.5, high_open=True, fix="use e.g. 0.1"),
    "dpo.simpo_gamma": Num(low=0.0, fix="use e.g. 0.5"),
    "grpo.k": count(fix="use e.g. 8 completions per prompt"),
    "grpo.prompts_per_step": count(fix="use e.g. 8"),
    "grpo.reward_weights": Num(fix="use e.g. 1.0 per reward function"),
    "grpo.max_new_tokens": count(fix="use e.g. 8"),
    "grpo.temperature": Num(
        low=0.0,
        low_open=True,
        fix="use e.g. 1.0 (at 0 the k completions would all be the greedy one)",
    ),
    "grpo.top_k": count(0, fix="use e.g. 50, or 0 for every token"),
    "grpo.epsilon_low": Num(low=0.0, fix="use e.g. 0.2"),
    "grpo.epsilon_high": Num(low=0.0, fix="use e.g. 0.2 (or 0.28, DAPO's)"),
    "grpo.kl_coef": Num(low=0.0, fix="use e.g. 0.04, or 0 for no reference"),
    "grpo.seed": Num(low=0, high=2**63 - 1, integer=True, fix="use e.g. 0"),
}


def is_numeric(annotation: Any) -> bool:
    """An ``int`` or ``float`` field (optional or not; lists of numbers count too)."""
    args = [a for a in get_args(annotation) if a is not type(None)] or [annotation]
    for a in args:
        if get_origin(a) is list:
            a = get_args(a)[0]
        if a in (int, float):
            return True
    return False


def _get(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def validate_values(cfg: JobConfig) -> None:
    """Every ruled number in range and every choice field one of its options (a config built
    in Python skips the parser's checks)."""
    for path, annotation, _default, _doc in iter_fields():
        value = _get(cfg, path)
        rule = RULES.get(path)
        if rule is not None and not (value is None and _optional(annotation)):
            values = value if isinstance(value, list) else [value]  # a list: each element
            problem = next((p for v in values if (p := rule.problem(v)) is not None), None)
            if problem is not None:
                raise ConfigError(
                    path, value, problem, rule.fix or f"use a value {rule.describe()}"
                )
        choices = _choices(annotation)
        if choices and value not in choices and not (value is None and _optional(annotation)):
            raise ConfigError(path, value, f"must be one of {list(choices)}", "pick one of them")


def _optional(annotation: Any) -> bool:
    return type(None) in get_args(annotation)


def _choices(annotation: Any) -> tuple[Any, ...]:
    args = [a for a in get_args(annotation) if a is not type(None)]
    inner = args[0] if len(args) == 1 and _optional(annotation) else annotation
    return get_args(inner) if get_origin(inner) is Literal else ()


__all__ = ["AUTO", "Num", "RULES", "count", "fraction", "is_numeric", "validate_values"]
