"""Checks of the optimizer's parameter groups and Muon options (docs/optimizers.md), before any
process group: every ``[[optimizer.groups]]`` field in range, Muon only where it applies, and
every rule matching at least one parameter of the model (built on ``meta``)."""

from __future__ import annotations

import math

import torch

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig, OptimizerGroup
from torchtitan.models import MODELS, flavor_args, flavor_of
from torchtitan.optim.param_groups import KINDS, MUON_KINDS, param_kinds, resolve, rule_matches

_OPTIMIZERS = ("default", "AdamW", "Muon")


def validate_optimizer(cfg: JobConfig) -> None:
    o = cfg.optimizer
    for i, rule in enumerate(o.groups):
        _validate_rule(f"optimizer.groups[{i}]", rule, o.name, o.lr)
    if o.name == "Muon" and (o.moments_dtype != "float32" or o.master_weights_dtype != "float32"):
        field = "moments_dtype" if o.moments_dtype != "float32" else "master_weights_dtype"
        raise ConfigError(
            f"optimizer.{field}",
            "bfloat16",
            "Muon's AdamW groups use torch's AdamW, without the stochastically rounded bf16 "
            "state of LowPrecisionAdamW",
            f"use --optimizer.{field} float32 with Muon, or optimizer.name = AdamW",
        )
    if o.groups:
        _validate_matches(cfg)


def _validate_rule(where: str, rule: OptimizerGroup, name: str, lr: float) -> None:
    bad = [k for k in rule.kinds if k not in KINDS]
    if bad:
        raise ConfigError(
            f"{where}.kinds",
            bad,
            "names no parameter kind",
            f"use kinds from {list(KINDS)} (docs/optimizers.md)",
        )
    if any(not isinstance(n, str) or not n for n in rule.names):
        raise ConfigError(
            f"{where}.names", rule.names, "holds an empty pattern", 'use e.g. ["layers.0.*"]'
        )
    if rule.optimizer not in _OPTIMIZERS:
        raise ConfigError(
            f"{where}.optimizer", rule.optimizer, f"must be one of {list(_OPTIMIZERS)}", "pick one"
        )
    lr_mult = rule.lr_mult
    if isinstance(lr_mult, bool) or not isinstance(lr_mult, (int, float)):
        raise ConfigError(f"{where}.lr_mult", lr_mult, "must be a number", "use e.g. 0.5")
    if not math.isfinite(lr_mult) or lr_mult <= 0:
        raise ConfigError(f"{where}.lr_mult", lr_mult, "must be a finite number > 0", "use 1.0")
    if lr * lr_mult > 1.0:
        # the bound of optimizer.lr (validate_values.py), applied to each group's effective LR
        raise ConfigError(
            f"{where}.lr_mult",
            lr_mult,
            f"makes the group's learning rate optimizer.lr x lr_mult = {lr:g} x {lr_mult:g} = "
            f"{lr * lr_mult:g}, above 1 (the bound of optimizer.lr holds for every group)",
            f"use lr_mult <= {1.0 / lr:.6g}",
        )
    wd = rule.weight_decay
    if isinstance(wd, bool) or not isinstance(wd, (int, float)):
        raise ConfigError(f"{where}.weight_decay", wd, "must be a number", "use e.g. 0.0")
    if not math.isfinite(wd) or (wd < 0 and wd != -1):
        raise ConfigError(
            f"{where}.weight_decay", wd, "must be >= 0 or -1", "use -1 (the kind's default) or 0"
        )
    if rule.optimizer == "Muon" and name != "Muon":
        raise ConfigError(
            f"{where}.optimizer",
            "Muon",
            f"needs optimizer.name = Muon (it is {name})",
            "set --optimizer.name Muon (AdamW then serves every other group)",
        )
    if rule.optimizer == "Muon" and not set(rule.kinds or KINDS) <= set(MUON_KINDS):
        raise ConfigError(
            f"{where}.kinds",
            rule.kinds,
            f"Muon takes only {list(MUON_KINDS)} (matrices, expert stacks)",
            'give kinds = ["matrix"] or ["matrix", "experts"]',
        )


def _validate_matches(cfg: JobConfig) -> None:
    """Every rule takes some parameter of the whole model (a pipeline stage may hold none of a
    rule's parameters, so the trainer cannot check it on a stage)."""
    spec = MODELS.get(cfg.model.name)
    if spec is None or flavor_of(cfg) not in spec.flavors:
        return  # the model checks name these fields
    args = flavor_args(cfg)
    with torch.device("meta"):
        model = spec.build(args)
    plan = spec.parallel_plan(args)
    kinds = param_kinds(model, plan.tensor_parallel.output, plan.embedding)
    o = cfg.optimizer
    taken: set[int] = set()
    for name, kind in kinds.items():
        _, idx = resolve(name, kind, o.groups, o.name, o.weight_decay)
        if idx is not None:
            taken.add(idx)
    for i, rule in enumerate(o.groups):
        if i not in taken:
            hit = any(rule_matches(rule, n, k) for n, k in kinds.items())
            why = "an earlier rule takes all it matches" if hit else "it matches no parameter"
            raise ConfigError(
                f"optimizer.groups[{i}]",
                f"kinds={rule.kinds} names={rule.names}",
                f"{why} of {cfg.model.name}/{cfg.model.flavor}",
                "fix its kinds/names patterns (docs/optimizers.md lists the kinds), or remove it",
            )


__all__ = ["validate_optimizer"]
