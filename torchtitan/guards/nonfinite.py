"""Non-finite loss / gradient-norm detection at the step it happens
(docs/architecture.md, section 9).

After gradient clipping the trainer asks :meth:`NonFiniteGuard.check` whether the step may go to
the optimizer. The test is one host read of two scalars (this rank's loss and the global gradient
norm, which every rank shares). When either is NaN/inf the guard finds the first parameter (in
stage, then parameter order) whose gradient is non-finite on *any* rank, with one all-reduce and
one small broadcast (only on that failure path), and then, by ``training.nonfinite_policy``:

- ``raise`` (default): raises :class:`NonFiniteError` naming the step, the rank and the parameter;
- ``skip_step``: logs the same message, skips ``optimizer.step()`` (the weights and the optimizer
  state stay as they were; the LR schedule still advances with the step count) and counts it.

Every rank takes the same decision because the gradient norm is reduced over all ranks (and
pipeline stages) before the check; a non-finite loss always makes the gradients non-finite.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan.distributed.utils import device_type
from torchtitan.tools.logging import logger

__all__ = ["NonFiniteError", "NonFiniteGuard", "first_nonfinite_grad"]

_NONE = (1 << 62) - 1
_RANK_BITS = 20


class NonFiniteError(FloatingPointError):
    """A NaN or inf in the loss or the gradients, under ``nonfinite_policy = "raise"``."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def first_nonfinite_grad(
    model_parts: Sequence[nn.Module],
) -> tuple[int, int, str, int] | None:
    """(part index, parameter index, name, number of parameters with non-finite gradients) of
    the first parameter whose local gradient has a NaN/inf on this rank, or ``None``."""
    first: tuple[int, int, str] | None = None
    count = 0
    for part_idx, part in enumerate(model_parts):
        for param_idx, (name, p) in enumerate(part.named_parameters()):
            if p.grad is None:
                continue
            g = _local(p.grad)
            if g.numel() and not bool(torch.isfinite(g).all()):
                count += 1
                if first is None:
                    first = (part_idx, param_idx, name)
    return None if first is None else (*first, count)


class NonFiniteGuard:
    """Checks each step's loss and gradient norm; see the module docstring."""

    def __init__(
        self,
        policy: Literal["raise", "skip_step"],
        *,
        rank: int,
        stage_ids: Sequence[int] | None = None,
    ) -> None:
        self.policy = policy
        self.rank = rank
        # Global order of this rank's model parts (pipeline stage ids); [0] without PP.
        self.stage_ids = list(stage_ids) if stage_ids else None
        self.skipped_steps = 0
        self.last_loss = 0.0

    def check(
        self,
        step: int,
        loss: torch.Tensor,
        grad_norm: torch.Tensor,
        model_parts: Sequence[nn.Module],
    ) -> bool:
        """True when the step may go to the optimizer; raises or counts a skip otherwise."""
        values = torch.stack([_local(loss).detach().float(), _local(grad_norm).detach().float()])
        loss_v, norm_v = values.tolist()  # the one host sync per step
        self.last_loss = loss_v  # for the spike detector (guards/spikes.py)
        if torch.isfinite(values).all():
            return True
        where = self._locate(model_parts, grads_bad=norm_v != norm_v or abs(norm_v) == float("inf"))
        msg = (
            f"non-finite values at step {step}: loss {loss_v} on rank {self.rank}, "
            f"gradient norm {norm_v}; {where}"
        )
        if self.policy == "raise":
            logger.error(msg)
            raise NonFiniteError(
                msg + ". Lower the learning rate, check the data of this step, or set "
                "training.nonfinite_policy = 'skip_step' to skip such steps"
            )
        self.skipped_steps += 1
        logger.warning(
            f"{msg}; optimizer step skipped (training.nonfinite_policy = 'skip_step'; "
            f"{self.skipped_steps} skipped so far)"
        )
        return False

    def _locate(self, model_parts: Sequence[nn.Module], grads_bad: bool) -> str:
        """Name the first parameter with a non-finite gradient over all ranks.

        Collective only when the (globally reduced) gradient norm is bad, which every rank sees
        alike; a bad loss with finite gradients (which should not happen) is reported locally.
        """
        mine = first_nonfinite_grad(model_parts)
        stage_of = self.stage_ids or list(range(len(model_parts)))
        multi = len(model_parts) > 1 or self.stage_ids is not None
        if not (grads_bad and dist.is_initialized() and dist.get_world_size() > 1):
            if mine is None:
                return "no non-finite gradient on this rank"
            part, _, name, count = mine
            stage = f" (stage {stage_of[part]})" if multi else ""
            return (
                f"first non-finite gradient: {name}{stage} on rank {self.rank} "
                f"({count} parameters affected on this rank)"
            )
        # Smallest (stage, parameter index) over the ranks, with the rank holding it.
        key = _NONE
        if mine is not None:
            part, idx, _, _ = mine
            key = (((stage_of[part] << 20) | idx) << _RANK_BITS) | self.rank
        # CPU tensors unless the only backend is NCCL ("cuda:nccl,cpu:gloo" takes CPU ones).
        backend = str(dist.get_backend())
        device = "cpu" if "gloo" in backend or device_type() != "cuda" else "cuda"
        t = torch.tensor([key, mine[3] if mine else 0], dtype=torch.int64, device=device)
        best = t[:1].clone()
        dist.all_reduce(best, op=dist.ReduceOp.MIN)
        total = t[1:].clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        best_key, n_bad = int(best.item()), int(total.item())
        if best_key == _NONE:
            return "no rank holds a non-finite gradient (the norm overflowed)"
        src = best_key & ((1 << _RANK_BITS) - 1)
        holder = [mine[2] if mine is not None and src == self.rank else ""]
        dist.broadcast_object_list(holder, src=src)
        stage = f" (stage {best_key >> (_RANK_BITS + 20)})" if multi else ""
        return (
            f"first non-finite gradient: {holder[0]}{stage} on rank {src} "
            f"({n_bad} parameter shards affected over all ranks)"
        )
