"""Command-line parsing: negation only for real boolean fields, unknown names named in full with
the nearest valid one (issue 18, item 1)."""

from __future__ import annotations

import pytest

from torchtitan.config.errors import ConfigError
from torchtitan.config.manager import parse_args


@pytest.mark.parametrize(
    ("argv", "key"),
    [
        (["--training.no_such_field=3"], "training.no_such_field"),
        (["--training.no_such_field", "3"], "training.no_such_field"),
        (["--training.no-such-field", "3"], "training.no_such_field"),
        (["--no_such.steps", "3"], "no_such"),
    ],
)
def test_unknown_no_prefixed_key_is_named_in_full(argv: list[str], key: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_args(argv)
    assert e.value.field == key
    assert "is not a" in e.value.rule


def test_negation_only_for_boolean_fields() -> None:
    cfg = parse_args(["--compile.enable", "--no-compile.enable", "--metrics.no-enable-jsonl"])
    assert cfg.compile.enable is False and cfg.metrics.enable_jsonl is False
    with pytest.raises(ConfigError, match="only applies to boolean"):
        parse_args(["--training.no_steps", "3"])


@pytest.mark.parametrize(
    ("argv", "field", "suggestion"),
    [
        (["--trainin.steps", "3"], "trainin", "did you mean 'training'"),
        (["--training.stepz", "3"], "training.stepz", "did you mean 'steps'"),
        (["--training.lr", "3"], "training.lr", "did you mean 'optimizer.lr'"),
        (["--optimizer.beta_1", "0.9"], "optimizer.beta_1", "did you mean 'beta1'"),
    ],
)
def test_unknown_names_suggest_the_nearest(argv: list[str], field: str, suggestion: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_args(argv)
    assert e.value.field == field
    assert suggestion in e.value.fix
