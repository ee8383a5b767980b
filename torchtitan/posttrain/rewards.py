"""GRPO's reward functions, a small registry (docs/posttrain.md, "Rewards").

A reward function takes ``(completion, answer)`` (the decoded completion text and the prompt
record's ``answer``, or None) and returns a float. Built in:

- ``exact_match``: 1.0 when the last number in the completion equals the answer's, else 0.0
  (math answers: "12", "The sum is 12." and "12.0" all match "12");
- ``format``: 1.0 when the completion is just a number (optionally signed, with a decimal part),
  else 0.0;
- any other name is an import path ``package.module:function`` of a user-supplied callable.

:func:`score` evaluates every function on every completion of a group; a function that raises or
returns a non-finite value makes its whole group *failed*: the step skips the group (its
completions get no gradient) and counts it; nothing crashes.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable, Sequence

RewardFn = Callable[[str, "str | None"], float]

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _last_number(text: str) -> float | None:
    found = _NUMBER.findall(text)
    return float(found[-1]) if found else None


def exact_match(completion: str, answer: str | None) -> float:
    if answer is None:
        raise ValueError("exact_match needs an 'answer' in every prompt record")
    got, want = _last_number(completion), _last_number(answer)
    return 1.0 if got is not None and got == want else 0.0


def format_check(completion: str, answer: str | None) -> float:
    return 1.0 if re.fullmatch(r"\s*-?\d+(?:\.\d+)?\s*", completion) else 0.0


REWARDS: dict[str, RewardFn] = {"exact_match": exact_match, "format": format_check}


def resolve(name: str) -> RewardFn:
    """The registered function ``name`` or the callable at import path ``module:function``;
    ``ValueError`` naming the rule otherwise."""
    if name in REWARDS:
        return REWARDS[name]
    module, sep, attr = name.partition(":")
    if not sep or not module or not attr:
        raise ValueError(
            f"reward {name!r} is neither built in ({', '.join(REWARDS)}) nor an import path "
            f"'package.module:function'"
        )
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"reward {name!r} cannot be imported: {e}") from None
    if not callable(fn):
        raise ValueError(f"reward {name!r} is not callable")
    return fn  # type: ignore[no-any-return]


def score(
    fns: Sequence[RewardFn],
    weights: Sequence[float],
    completions: Sequence[str],
    answer: str | None,
) -> tuple[list[float], str | None]:
    """The weighted reward of each completion of one group, or ``([], reason)`` when a
    function raised or returned a non-finite value (the group is then skipped)."""
    out = []
    for text in completions:
        total = 0.0
        for fn, w in zip(fns, weights, strict=True):
            try:
                value = float(fn(text, answer))
            except Exception as e:  # noqa: BLE001 - a user's reward failing skips its group
                return [], f"{getattr(fn, '__name__', fn)} raised {type(e).__name__}: {e}"
            if not math.isfinite(value):
                return [], f"{getattr(fn, '__name__', fn)} returned {value}"
            total += w * value
        out.append(total)
    return out, None
