"""Shared pieces of the tier-3 parity matrix: one cached single-process reference and the check.

Every case trains the debug model for ``STEPS`` steps in fp32 on the same global batch (8
sequences of 64 tokens; ``training.data_sharding = window`` gives every data-parallel degree
exactly the same batch) and must match the single-process losses to ``LOSS_RTOL`` at every step.

Gradient norms are compared too, with a looser tolerance: the reference itself computes the
norm of ~6M fp32 values with a plain float32 reduction, which is only good to ~1e-4 relative
(the sharded runs sum the same squares in a different order). A norm that misses or double
counts a mesh axis is off by far more. Losses cannot catch that on their own, because AdamW
barely depends on the clipping scale.
"""

from __future__ import annotations

from pathlib import Path

import pytest

# Import the trainer in the parent so forked ranks start without re-importing it (seconds each).
import torchtitan.train  # noqa: F401
import torchtitan.training.trainer  # noqa: F401
from tests.parity import PP2_1F1B as PP2_1F1B  # the family parity modules import it from here
from tests.parity import assert_losses_match, losses, train_metrics

STEPS = 20
LOSS_RTOL = 1e-5
GRAD_NORM_RTOL = 5e-4

_REFERENCE: dict[int, list[dict]] = {}


def reference_metrics(tmp_path_factory: pytest.TempPathFactory, steps: int = STEPS) -> list[dict]:
    """Per-step metrics of the single-process run (local batch 8, no accumulation), run once
    per pytest session and shared by every parity module."""
    if steps not in _REFERENCE:
        dump = tmp_path_factory.mktemp(f"reference_{steps}")
        _REFERENCE[steps] = train_metrics(["--training.local_batch_size", "8"], 1, dump, steps)
        first, last = _REFERENCE[steps][0]["loss"], _REFERENCE[steps][-1]["loss"]
        assert last < first - 0.5, f"reference loss did not fall: {first:.3f} -> {last:.3f}"
    return _REFERENCE[steps]


def check_parity(
    reference: list[dict],
    overrides: list[str],
    world_size: int,
    dump: Path,
    label: str,
) -> tuple[float, float]:
    """Train ``overrides`` on ``world_size`` ranks and compare every step with ``reference``.

    Returns (worst relative loss difference, worst relative grad-norm difference); each
    assertion message names the worst step.
    """
    got = train_metrics(overrides, world_size, dump, len(reference))
    assert [m["step"] for m in got] == [m["step"] for m in reference], f"{label}: steps differ"
    loss_diff = assert_losses_match(losses(reference), losses(got), rtol=LOSS_RTOL, label=label)
    norm_diff = assert_grad_norms_match(reference, got, label)
    return loss_diff, norm_diff


def assert_grad_norms_match(reference: list[dict], got: list[dict], label: str) -> float:
    """Worst relative grad-norm difference over the steps; fails naming the worst step."""
    rel = [
        (abs(r["grad_norm"] - g["grad_norm"]) / abs(r["grad_norm"]), r["step"], r, g)
        for r, g in zip(reference, got)
    ]
    worst, step, r, g = max(rel, key=lambda x: x[0])
    msg = (
        f"{label}: worst relative grad-norm difference {worst:.3e} at step {step} "
        f"(reference {r['grad_norm']:.7f}, got {g['grad_norm']:.7f}); tolerance {GRAD_NORM_RTOL:.0e}"
    )
    print(msg)
    assert worst <= GRAD_NORM_RTOL, msg
    return worst


class FamilyParity:
    """One model family's parity runs (``test_<family>_parity.py``): a one-process reference per
    extra argument set (local batch 8, cached per session; its loss must fall by 0.3), and runs
    under a parallelism compared with it step by step (losses within 1e-5 relative, grad norms
    as above)."""

    def __init__(self, model: list[str], steps: int = 10) -> None:
        self.model, self.steps = model, steps
        self._references: dict[tuple[str, ...], list[dict]] = {}

    def reference(
        self, tmp_path_factory: pytest.TempPathFactory, extra: tuple[str, ...] = ()
    ) -> list[dict]:
        if extra not in self._references:
            dump = tmp_path_factory.mktemp("family_ref")
            argv = [*self.model, *extra, "--training.local_batch_size", "8"]
            ref = train_metrics(argv, 1, dump, self.steps)
            first, last = ref[0]["loss"], ref[-1]["loss"]
            assert last < first - 0.3, f"reference loss did not fall: {first:.3f} -> {last:.3f}"
            self._references[extra] = ref
        return self._references[extra]

    def compare(
        self,
        tmp_path_factory: pytest.TempPathFactory,
        tmp_path: Path,
        world: int,
        overrides: list[str],
        label: str,
        extra: tuple[str, ...] = (),
    ) -> tuple[list[dict], list[dict]]:
        """(reference, this run) after checking that they match."""
        ref = self.reference(tmp_path_factory, extra)
        got = train_metrics([*self.model, *extra, *overrides], world, tmp_path, self.steps)
        assert_losses_match(losses(ref), losses(got), rtol=LOSS_RTOL, label=label)
        assert_grad_norms_match(ref, got, label)
        return ref, got
