"""The one error type for bad configuration."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A config field has a value that breaks a rule; the message names the field, value, rule and fix."""

    def __init__(self, field: str, value: Any, rule: str, fix: str) -> None:
        # One line whatever a reader's message holds (docs/errors.md: never more than one).
        field, rule, fix = (" ".join(str(s).split("\n")).strip() for s in (field, rule, fix))
        field, rule, fix = (s.replace("\r", " ") for s in (field, rule, fix))
        self.field, self.value, self.rule, self.fix = field, value, rule, fix
        shown = "" if value is None else f" = {value!r}"
        super().__init__(f"{field}{shown}: {rule}. Fix: {fix}.")


def require_int(cfg: Any, dotted: str, minimum: int = 1) -> None:
    """The field ``dotted`` (e.g. ``training.steps``) of ``cfg`` is an integer >= ``minimum``."""
    value = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    if not isinstance(value, int) or value < minimum:
        raise ConfigError(
            dotted,
            value,
            f"must be an integer >= {minimum}",
            f"set --{dotted} to at least {minimum}",
        )
