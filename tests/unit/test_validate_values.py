"""Per-field rules (issue 18, item 1): every numeric field of JobConfig has a rule, and each rule
rejects non-finite and out-of-range values with the field's name."""

from __future__ import annotations

import math

import pytest

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig
from torchtitan.config.manager import iter_fields
from torchtitan.preflight.validate_values import RULES, is_numeric, validate_values


def test_every_numeric_field_has_a_rule() -> None:
    numeric = [path for path, tp, _d, _doc in iter_fields() if is_numeric(tp)]
    assert len(numeric) >= 38
    missing = [p for p in numeric if p not in RULES]
    assert not missing, (
        f"numeric config fields without a value rule: {missing}; add one line each to RULES in "
        "torchtitan/preflight/validate_values.py"
    )
    stale = sorted(set(RULES) - {p for p, *_ in iter_fields()})
    assert not stale, f"RULES names fields that do not exist: {stale}"


def test_defaults_pass() -> None:
    validate_values(JobConfig())


def _set(cfg: JobConfig, dotted: str, value: object) -> None:
    *head, last = dotted.split(".")
    obj: object = cfg
    for part in head:
        obj = getattr(obj, part)
    setattr(obj, last, value)


@pytest.mark.parametrize("path", sorted(RULES))
def test_every_rule_rejects_nan_inf_and_wrong_types(path: str) -> None:
    for bad in (math.nan, math.inf, -math.inf, "3", True):
        cfg = JobConfig()
        _set(cfg, path, bad)
        with pytest.raises(ConfigError) as e:
            validate_values(cfg)
        assert e.value.field == path


@pytest.mark.parametrize(
    ("path", "bad", "good"),
    [
        ("optimizer.lr", 0.0, 3e-4),
        ("optimizer.lr", -1e-3, 1.0),
        ("optimizer.beta1", 1.0, 0.0),
        ("optimizer.beta2", -0.1, 0.999),
        ("optimizer.eps", 0.0, 1e-12),
        ("optimizer.weight_decay", -0.1, 0.0),
        ("training.max_norm", math.nan, 0.0),
        ("training.global_batch_size", 0, -1),
        ("training.local_batch_size", 0, 1),
        ("lr_scheduler.decay_ratio", 1.5, 1.0),
        ("lr_scheduler.warmup_steps", -1, 0),
        ("checkpoint.load_step", -2, -1),
        ("metrics.memory_leak_window", 7, 0),
        ("comm.train_timeout_seconds", 0, 1),
        ("debug.seed", -1, 2**63 - 1),
        ("parallelism.data_parallel_shard_degree", 0, -1),
        ("validation.steps", 0, -1),
    ],
)
def test_range_edges(path: str, bad: object, good: object) -> None:
    cfg = JobConfig()
    _set(cfg, path, bad)
    with pytest.raises(ConfigError) as e:
        validate_values(cfg)
    assert e.value.field == path and e.value.fix
    _set(cfg, path, good)
    validate_values(cfg)


def test_choice_fields_checked_for_configs_built_in_python() -> None:
    cfg = JobConfig()
    cfg.optimizer.name = "SGD"  # type: ignore[assignment]
    with pytest.raises(ConfigError, match=r"optimizer.name = 'SGD': must be one of \['AdamW'"):
        validate_values(cfg)


def test_a_list_field_checks_each_element() -> None:
    """``grpo.reward_weights`` (a list of numbers): a NaN among fine weights is refused."""
    cfg = JobConfig()
    cfg.grpo.reward_weights = [1.0, float("nan")]
    with pytest.raises(ConfigError, match=r"grpo\.reward_weights.*finite"):
        validate_values(cfg)
    cfg.grpo.reward_weights = [1.0, 0.5]
    validate_values(cfg)
