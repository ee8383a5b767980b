"""RoPE scaling in ``config.json`` (``rope_parameters``, transformers >= 5; ``rope_scaling``
before) <-> ``models/common/rope.py``'s :data:`RopeScaling`, for the families whose args hold one
(``rope_scaling``: Llama 3, Qwen3). transformers' own rules are followed: ``rope_scaling`` wins
over ``rope_parameters`` when both are set, ``type`` is the old name of ``rope_type``,
``original_max_position_embeddings`` defaults to ``max_position_embeddings``, and YaRN's
``factor`` to their ratio; YaRN's ``attention_factor`` defaults to ``0.1 ln(factor) + 1``, or
with ``mscale`` and ``mscale_all_dim`` both set to the ratio of the two such magnitudes.

``dynamic`` (NTK) is refused: transformers recomputes its frequencies from each batch's longest
position once it passes ``original_max_position_embeddings``, so no one table reproduces it at
every length. ``longrope`` and the rest are not implemented: refused, naming what is.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from torchtitan.models.common.hf.keys import HFConfigError, HFKey, Rule, mapped, refused
from torchtitan.models.common.rope import LinearScaling, Llama3Scaling, RopeScaling, YarnScaling

SUPPORTED = ("default", "linear", "llama3", "yarn")
_WHY = {
    "dynamic": "dynamic NTK rescales by each batch's longest position, which no fixed RoPE "
    "table reproduces at every length",
}


def rope_params(config: Mapping[str, Any]) -> dict[str, Any]:
    """The scaling dict transformers uses: ``rope_scaling`` if set, else ``rope_parameters``."""
    return dict(config.get("rope_scaling") or config.get("rope_parameters") or {})


def rope_type(params: Mapping[str, Any]) -> str:
    return str(params.get("rope_type", params.get("type", "default")))


def _refuse(key: str, value: Any, rule: str, fix: str) -> HFConfigError:
    return HFConfigError(f"config.json: {key}", value, rule, fix)


def rope_rule(supported: tuple[str, ...] = SUPPORTED) -> Rule:
    """The key-table rule of ``rope_parameters`` / ``rope_scaling``: a ``rope_type`` among
    ``supported``, full rotary width."""

    def rule(value: Any, config: Mapping[str, Any]) -> tuple[str, str] | None:
        if not value:
            return None
        kind = rope_type(value)
        if kind not in supported:
            why = _WHY.get(kind, "not implemented")
            return f"rope_type {kind!r}: {why}; supported: {', '.join(supported)}", (
                "use one of those rope_type values (or convert the model with transformers first)"
            )
        if value.get("partial_rotary_factor", 1.0) != 1.0:
            return "partial rotary embeddings are not implemented (1.0 only)", "remove it"
        return None

    return rule


_check = rope_rule()


def rope_keys(
    ours: str = "rope_scaling", supported: tuple[str, ...] = SUPPORTED
) -> tuple[HFKey, ...]:
    """The table entries of the RoPE keys (``ours``: the args field(s) they set)."""
    rule = rope_rule(supported)
    return (
        mapped("rope_parameters", f"rope_theta, {ours} (rope_type {', '.join(supported)})", rule),
        mapped("rope_scaling", f"{ours} (transformers < 5; wins over rope_parameters)", rule),
        mapped("rope_theta", "rope_theta"),
        refused(
            "partial_rotary_factor",
            "partial rotary embeddings are not implemented",
            lambda v: v in (None, 1, 1.0),
        ),
    )


def yarn_from_params(p: Mapping[str, Any], config: Mapping[str, Any]) -> YarnScaling:
    """:class:`YarnScaling` from a ``rope_type: yarn`` dict, transformers' defaults applied."""
    max_pos = int(config.get("max_position_embeddings", 0) or 0)
    return _yarn(p, int(p.get("original_max_position_embeddings") or max_pos), max_pos)


def _yarn(p: Mapping[str, Any], original: int, max_pos: int) -> YarnScaling:
    factor = float(p.get("factor") or max_pos / original)
    attention = p.get("attention_factor")
    mscale, mscale_all = p.get("mscale"), p.get("mscale_all_dim")
    if attention is None and mscale and mscale_all:

        def magnitude(m: float) -> float:
            return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

        attention = magnitude(mscale) / magnitude(mscale_all)
    return YarnScaling(
        factor=factor,
        original_max_seq_len=original,
        beta_fast=float(p.get("beta_fast") or 32.0),
        beta_slow=float(p.get("beta_slow") or 1.0),
        truncate=bool(p.get("truncate", True)),
        attention_factor=None if attention is None else float(attention),
    )


def scaling_from_hf(config: Mapping[str, Any]) -> RopeScaling | None:
    """Our :data:`RopeScaling` for ``config`` (None: plain RoPE); refuses what we cannot compute."""
    p = rope_params(config)
    problem = _check(p, config)
    if problem is not None:
        raise _refuse("rope_parameters", p, *problem)
    kind = rope_type(p)
    max_pos = int(config.get("max_position_embeddings", 0) or 0)
    original = int(p.get("original_max_position_embeddings") or max_pos)
    if kind == "linear":
        return LinearScaling(float(p["factor"]))
    if kind == "llama3":
        return Llama3Scaling(
            float(p["factor"]),
            float(p.get("low_freq_factor", 1.0)),
            float(p.get("high_freq_factor", 4.0)),
            original,
        )
    if kind == "yarn":
        return _yarn(p, original, max_pos)
    return None


def scaling_to_hf(scaling: RopeScaling | None, theta: float) -> dict[str, Any]:
    """``rope_parameters`` (with ``rope_theta``) and the same scaling as ``rope_scaling``."""
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if isinstance(scaling, LinearScaling):
        params.update(rope_type="linear", factor=scaling.factor)
    elif isinstance(scaling, Llama3Scaling):
        params.update(
            rope_type="llama3",
            factor=scaling.factor,
            low_freq_factor=scaling.low_freq_factor,
            high_freq_factor=scaling.high_freq_factor,
            original_max_position_embeddings=scaling.original_max_seq_len,
        )
    elif isinstance(scaling, YarnScaling):
        params.update(
            rope_type="yarn",
            factor=scaling.factor,
            original_max_position_embeddings=scaling.original_max_seq_len,
            beta_fast=scaling.beta_fast,
            beta_slow=scaling.beta_slow,
            truncate=scaling.truncate,
        )
        if scaling.attention_factor is not None:
            params["attention_factor"] = scaling.attention_factor
    return {"rope_parameters": params, "rope_scaling": params if scaling is not None else None}


class RopeSection:
    """The ``HFConfig`` section of a family whose args hold ``rope_scaling``."""

    def to_hf(self, args: Any) -> dict[str, Any]:
        return scaling_to_hf(args.rope_scaling, args.rope_theta)

    def from_hf(self, config: Mapping[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {"rope_scaling": scaling_from_hf(config)}
        theta = rope_params(config).get("rope_theta")
        if theta is not None:  # transformers: rope_parameters' theta wins over rope_theta
            out["rope_theta"] = float(theta)
        return out
