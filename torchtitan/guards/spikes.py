"""Loss spikes and runs of skipped steps (docs/observability.md, "Loss spikes").

:class:`SpikeDetector` scores each step's loss against the previous ``window`` accepted losses
with a robust z-score, ``(loss - median) / (1.4826 * MAD)``; a score above ``threshold`` after
``warmup`` steps is a spike. Only upward jumps count (a loss that drops is not a problem).

:class:`StepGuard` applies ``training.spike_policy`` on every rank alike:

- ``warn``: log the event and train on;
- ``skip_step``: skip the optimizer step (weights and optimizer state unchanged);
- ``rollback``: reload the newest checkpoint before the step and skip the step's batches when
  training reaches it again (the trainer does the reload; before the first checkpoint the step
  is skipped instead).

Each rank scores its own loss (its data-parallel share of the batch), so the event names the
rank and the position of the offending microbatches in that rank's data stream. The ranks agree
with one int64 MAX all-reduce per step, packing the largest score and its rank: that is the
detector's only cost, since the loss is already on the host (the non-finite check reads it every
step). With ``spike_policy = "off"`` nothing runs.

Skips of either kind (spike, non-finite values) are counted: ``max_consecutive_skips`` skips in a
row abort training (:class:`TrainingAborted`), and so do weights that have themselves become
non-finite (checked, with one all-reduce, only when a step is skipped): skipping cannot repair
them, and every later step and checkpoint would carry the NaNs.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan.config.job_config import Training
from torchtitan.distributed.utils import device_type
from torchtitan.tools.logging import logger

__all__ = ["SpikeDetector", "StepGuard", "TrainingAborted", "weights_finite"]

SpikePolicy = Literal["off", "warn", "skip_step", "rollback"]
_MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution times this is its standard deviation
_RANK_BITS = 20
_SCORE_SCALE = 1000  # the score travels as an integer in thousandths


class TrainingAborted(RuntimeError):
    """Skipping steps cannot save this run (too many in a row, or non-finite weights)."""


class SpikeDetector:
    """Robust z-score of a loss against a window of recent accepted losses."""

    def __init__(self, window: int, threshold: float, warmup: int) -> None:
        self.window, self.threshold, self.warmup = window, threshold, warmup
        self.history: deque[tuple[int, float]] = deque(maxlen=window)

    def score(self, loss: float) -> float:
        """The robust z-score of ``loss``; 0 while fewer than ``warmup`` losses were seen."""
        if len(self.history) < max(self.warmup, 3):
            return 0.0
        values = [v for _, v in self.history]
        median = statistics.median(values)
        mad = statistics.median(abs(v - median) for v in values)
        # A flat history (MAD 0) would make every change infinite: floor the spread at 1e-3 of
        # the median's size.
        spread = max(_MAD_TO_SIGMA * mad, 1e-3 * abs(median), 1e-12)
        return (loss - median) / spread

    def accept(self, step: int, loss: float) -> None:
        self.history.append((step, loss))

    def forget_after(self, step: int) -> None:
        """Drop losses of steps after ``step`` (they are trained again after a rollback)."""
        kept = [(s, v) for s, v in self.history if s <= step]
        self.history.clear()
        self.history.extend(kept)


def _collective_device() -> str:
    backend = str(dist.get_backend())
    return "cpu" if "gloo" in backend or device_type() != "cuda" else "cuda"


def _shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a (possibly sharded) DTensor."""
    return t.to_local() if isinstance(t, DTensor) else t


def weights_finite(model_parts: Sequence[nn.Module]) -> bool:
    """Whether every trained parameter on every rank is finite (one all-reduce). A frozen one
    (a LoRA base, possibly NF4 codes that have no ``isfinite``) cannot have changed."""
    ok = all(
        bool(torch.isfinite(_shard(p.detach())).all())
        for part in model_parts
        for p in part.parameters()
        if p.requires_grad
    )
    if dist.is_initialized() and dist.get_world_size() > 1:
        t = torch.tensor([int(ok)], dtype=torch.int32, device=_collective_device())
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        ok = bool(t.item())
    return ok


class StepGuard:
    """Spike policy and the consecutive-skip limit; see the module docstring."""

    def __init__(
        self,
        policy: SpikePolicy,
        *,
        window: int,
        threshold: float,
        warmup: int,
        max_consecutive_skips: int,
        rank: int,
    ) -> None:
        self.policy = policy
        self.detector = SpikeDetector(window, threshold, warmup)
        self.max_consecutive_skips = max_consecutive_skips
        self.rank = rank
        self.consecutive_skips = 0
        self.spikes = 0
        self.events: list[dict[str, float | int | str]] = []
        self._skip_batches: dict[int, int] = {}
        self._rollbacks: dict[int, int] = {}

    @classmethod
    def from_config(cls, training: Training, rank: int) -> StepGuard:
        """The guard ``[training]``'s spike fields ask for."""
        t = training
        return cls(
            t.spike_policy,
            window=t.spike_window,
            threshold=t.spike_threshold,
            warmup=t.spike_warmup,
            max_consecutive_skips=t.max_consecutive_skips,
            rank=rank,
        )

    def check(self, step: int, loss: float, position: str) -> str:
        """``"step"`` (go to the optimizer), ``"skip"`` or ``"rollback"`` for a finite loss."""
        if self.policy == "off":
            return "step"
        z = self.detector.score(loss)
        spiked = z > self.detector.threshold
        key = (min(int(max(z, 0.0) * _SCORE_SCALE), 1 << 40) << _RANK_BITS) | self.rank
        key = key if spiked else 0
        if dist.is_initialized() and dist.get_world_size() > 1:
            t = torch.tensor([key], dtype=torch.int64, device=_collective_device())
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            key = int(t.item())
        if key == 0:
            self.detector.accept(step, loss)
            return "step"
        self.spikes += 1
        src = key & ((1 << _RANK_BITS) - 1)
        score = (key >> _RANK_BITS) / _SCORE_SCALE
        action = {"warn": "training on", "skip_step": "optimizer step skipped"}.get(
            self.policy, "rolling back to the last checkpoint"
        )
        where = f"; its batch: {position}" if src == self.rank else ""
        event: dict[str, float | int | str] = {
            "step": step,
            "rank": src,
            "score": score,
            "policy": str(self.policy),
        }
        self.events.append(event)
        logger.warning(
            f"loss spike at step {step} on rank {src}: robust z-score {score:.1f} > "
            f"{self.detector.threshold} (this rank's loss {loss:.4f}){where}; "
            f"training.spike_policy = {self.policy!r}: {action}"
        )
        if self.policy == "warn":
            self.detector.accept(step, loss)
            return "step"
        return "skip" if self.policy == "skip_step" else "rollback"

    def stepped(self) -> None:
        self.consecutive_skips = 0

    def skipped(self, step: int, reason: str, model_parts: Sequence[nn.Module]) -> None:
        """Count a skipped step; abort on a run of them or on non-finite weights (collective:
        every rank skips the same steps)."""
        self.consecutive_skips += 1
        if not weights_finite(model_parts):
            raise TrainingAborted(
                f"step {step} was skipped ({reason}) and the weights themselves are "
                "non-finite: skipping steps cannot recover them. Resume from an earlier "
                "checkpoint with a lower learning rate"
            )
        limit = self.max_consecutive_skips
        if limit > 0 and self.consecutive_skips >= limit:
            raise TrainingAborted(
                f"{self.consecutive_skips} consecutive steps skipped (the last at step {step}: "
                f"{reason}); training.max_consecutive_skips = {limit}. The run is diverging: "
                "resume from an earlier checkpoint with a lower learning rate or check the data"
            )

    def rolled_back(self, bad_step: int, to_step: int, microbatches: int) -> None:
        """After a reload of step ``to_step``: skip the ``microbatches`` of ``bad_step`` when
        training reaches it again, and forget the losses of the steps trained again. Rolling
        back for the same step ``max_consecutive_skips`` times aborts."""
        n = self._rollbacks[bad_step] = self._rollbacks.get(bad_step, 0) + 1
        limit = self.max_consecutive_skips
        if limit > 0 and n >= limit:
            raise TrainingAborted(
                f"step {bad_step} spiked again after {n} rollbacks to step {to_step}, each "
                f"skipping its batches (training.max_consecutive_skips = {limit}): the run is "
                "diverging, not the data. Lower the learning rate"
            )
        self._skip_batches[bad_step] = self._skip_batches.get(bad_step, 0) + microbatches
        self.detector.forget_after(to_step)

    def batches_to_skip(self, step: int) -> int:
        return self._skip_batches.pop(step, 0)
