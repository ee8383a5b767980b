"""Parameter groups: each parameter's kind, the rule that sets its optimizer, lr multiplier and
weight decay, and the torch ``param_groups`` they make (docs/optimizers.md).

A kind comes from generic module types or from the module's own declaration, never from a
model family's attribute names: ``nn.Embedding`` (or the plan's embedding path) is
``embedding``; the plan's output projection is ``output``; ``nn.RMSNorm``/``nn.LayerNorm`` (or
any module whose class name ends in ``Norm``) hold ``norm`` weights; a parameter named ``bias``
is a ``bias``; a module whose class declares ``param_kind`` (the MoE ``Router`` and ``Experts``)
gives its parameters that kind; any other parameter of two or more dimensions is a ``matrix``
and the rest are ``other``.
"""

from __future__ import annotations

import fnmatch
from collections import Counter
from dataclasses import dataclass
from typing import Any

from torch import nn

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import OptimizerGroup
from torchtitan.tools.logging import logger

KINDS = ("matrix", "embedding", "output", "norm", "bias", "router", "experts", "other")
MUON_KINDS = ("matrix", "experts")  # the kinds Muon may take: 2-D matrices, 3-D expert stacks


@dataclass(frozen=True)
class KindDefault:
    muon: bool
    """Under optimizer.name = Muon, this kind is updated by Muon (else AdamW)."""
    decay: bool
    """Weight decay applies (optimizer.weight_decay); False: none."""


# No decay on norm gains, biases and embeddings (their scale is not a capacity to regularise,
# and decaying rare tokens' rows shrinks them toward zero); the router stays on AdamW under Muon
# (E rows: orthogonalising it would equalise the experts' logit scales). docs/optimizers.md.
DEFAULTS: dict[str, KindDefault] = {
    "matrix": KindDefault(muon=True, decay=True),
    "experts": KindDefault(muon=True, decay=True),
    "router": KindDefault(muon=False, decay=True),
    "output": KindDefault(muon=False, decay=True),
    "embedding": KindDefault(muon=False, decay=False),
    "norm": KindDefault(muon=False, decay=False),
    "bias": KindDefault(muon=False, decay=False),
    "other": KindDefault(muon=False, decay=False),
}


def _module_kind(module: nn.Module) -> str | None:
    declared = getattr(type(module), "param_kind", None)
    if isinstance(declared, str):
        return declared
    if isinstance(module, nn.Embedding):
        return "embedding"
    if isinstance(module, (nn.RMSNorm, nn.LayerNorm)) or type(module).__name__.endswith("Norm"):
        return "norm"
    return None


_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.")


def clean_name(name: str) -> str:
    """A parameter name as the checkpoint spells it (without activation-checkpoint or compile
    wrapper segments)."""
    for w in _WRAPPERS:
        name = name.replace(w, "")
    return name


def param_kinds(
    part: nn.Module, output: str | None = None, embedding: str | None = None
) -> dict[str, str]:
    """Full parameter name -> kind for one model part (``output``/``embedding``: module paths
    of the plan's output projection and token embedding)."""
    kinds: dict[str, str] = {}
    for raw_name, module in part.named_modules():
        mod_name = clean_name(raw_name)
        inherited = _module_kind(module)
        if mod_name and mod_name == output:
            inherited = "output"
        elif mod_name and mod_name == embedding:
            inherited = "embedding"
        for pname, p in module.named_parameters(recurse=False):
            full = f"{mod_name}.{pname}" if mod_name else pname
            if inherited is not None and (pname != "bias" or inherited in ("norm", "router")):
                kinds[full] = inherited
            elif pname == "bias" or full.endswith("_bias"):
                kinds[full] = "bias"
            else:
                kinds[full] = "matrix" if p.ndim >= 2 else "other"
    # A declared kind covers the module's submodules too (the Router's gate Linear).
    # Biases keep their own kind unless the declared one is a norm's or the router's (GPT-OSS's
    # experts' stacked biases are biases, not expert matrices).
    for raw_name, module in part.named_modules():
        declared = getattr(type(module), "param_kind", None)
        if isinstance(declared, str) and raw_name:
            for pname, _ in module.named_parameters():
                leaf = pname.rsplit(".", 1)[-1]
                is_bias = leaf == "bias" or leaf.endswith("_bias")
                own = "bias" if is_bias and declared not in ("norm", "router") else declared
                kinds[clean_name(f"{raw_name}.{pname}")] = own
    return kinds


def rule_matches(rule: OptimizerGroup, name: str, kind: str) -> bool:
    kind_ok = not rule.kinds or kind in rule.kinds
    name_ok = not rule.names or any(fnmatch.fnmatchcase(name, pat) for pat in rule.names)
    return kind_ok and name_ok


@dataclass(frozen=True)
class Setting:
    """What a parameter gets: its update rule, lr multiplier and weight decay, and why."""

    algorithm: str  # "muon" or "adamw" (Adam/AdamW: the run's optimizer.name)
    lr_mult: float
    weight_decay: float
    source: str  # "default:<kind>" or "groups[i]"


def resolve(
    name: str, kind: str, rules: list[OptimizerGroup], optimizer: str, weight_decay: float
) -> tuple[Setting, int | None]:
    """The setting of one parameter and the index of the rule that set it (None: default)."""
    d = DEFAULTS[kind]
    algorithm = "muon" if optimizer == "Muon" and d.muon else "adamw"
    decay = weight_decay if d.decay else 0.0
    for i, rule in enumerate(rules):
        if rule_matches(rule, name, kind):
            if rule.optimizer != "default":
                algorithm = rule.optimizer.lower()
            wd = decay if rule.weight_decay < 0 else rule.weight_decay
            if algorithm == "muon" and kind not in MUON_KINDS:
                raise ConfigError(
                    f"optimizer.groups[{i}].optimizer",
                    rule.optimizer,
                    f"matches {name}, a {kind} parameter, but Muon takes only {MUON_KINDS}",
                    'restrict the rule with kinds = ["matrix", "experts"] or use AdamW',
                )
            return Setting(algorithm, rule.lr_mult, wd, f"groups[{i}]"), i
    return Setting(algorithm, 1.0, decay, f"default:{kind}"), None


def build_param_groups(
    named: list[tuple[str, nn.Parameter, str]],
    rules: list[OptimizerGroup],
    optimizer: str,
    lr: float,
    weight_decay: float,
    strict: bool = True,
) -> list[dict[str, Any]]:
    """torch param groups (one per distinct setting) for ``(name, param, kind)`` triples, in
    first-seen order. ``strict``: a rule that matches no parameter is a ConfigError (off on a
    pipeline stage, which may hold none of a rule's parameters; preflight checks the whole
    model, ``preflight/validate_optim.py``)."""
    groups: dict[Setting, dict[str, Any]] = {}
    used: set[int] = set()
    for name, p, kind in named:
        setting, idx = resolve(name, kind, rules, optimizer, weight_decay)
        if idx is not None:
            used.add(idx)
        g = groups.setdefault(
            setting,
            {
                "params": [],
                "names": [],
                "kinds": Counter(),
                "lr": lr * setting.lr_mult,
                "lr_mult": setting.lr_mult,
                "weight_decay": setting.weight_decay,
                "algorithm": setting.algorithm,
                "group": setting.source,
            },
        )
        g["params"].append(p)
        g["names"].append(name)
        g["kinds"][kind] += 1
    for i, rule in enumerate(rules):
        if strict and i not in used:
            raise ConfigError(
                f"optimizer.groups[{i}]",
                f"kinds={rule.kinds} names={rule.names}",
                "matches no parameter of the model (or an earlier rule took them all)",
                "fix the kinds/names patterns, or remove the rule (the log lists every group)",
            )
    out = list(groups.values())
    log_groups(out)
    for g in out:  # the names and counts are for the log only: the state dict keeps plain keys
        g.pop("names")
        g["kinds"] = ",".join(sorted(g["kinds"]))
    return out


def log_groups(groups: list[dict[str, Any]]) -> None:
    for g in groups:
        n = sum(p.numel() for p in g["params"])
        kinds = ", ".join(f"{k} {c}" for k, c in sorted(g["kinds"].items()))
        logger.info(
            f"optimizer group {g['group']}: {g['algorithm']} lr x{g['lr_mult']:g} "
            f"weight_decay {g['weight_decay']:g}: {len(g['params'])} tensors, {n:,} elements "
            f"({kinds})"
        )


__all__ = ["DEFAULTS", "KINDS", "MUON_KINDS", "build_param_groups", "param_kinds", "resolve"]
