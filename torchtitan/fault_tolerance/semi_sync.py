"""Semi-synchronous training across replica groups (docs/fault_tolerance.md, "Semi-synchronous
training"): torchft's ``LocalSGD`` and ``DiLoCo`` over this rank's model parts.

Each group takes its inner steps alone (no cross-group gradient all-reduce); every
``fault_tolerance.sync_every`` inner steps the groups join a quorum and either average their
parameters (``local_sgd``) or average their pseudo-gradients (the weights of the last sync minus
the local weights) and apply them with an outer Nesterov SGD (``diloco``, the DiLoCo paper's
outer optimizer). torchft keeps DiLoCo's last-synced weights (on the CPU) and the outer
optimizer in the state a recovering group receives from a peer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from torchtitan.config.sections import FaultTolerance
from torchtitan.fault_tolerance.outer_state import OuterState


class SemiSync:
    """torchft's LocalSGD or DiLoCo for one rank. The trainer calls ``after_inner_step`` once
    per step, whether or not the inner optimizer stepped (a step skipped by the non-finite
    guard still counts), so every group syncs at the same steps; torchft's own optimizer hooks
    would skip the count with the step and leave the groups out of lockstep."""

    def __init__(
        self,
        ft: FaultTolerance,
        manager: Any,
        model_parts: list[nn.Module],
        optimizer: torch.optim.Optimizer,
        step: int,
        outer_state: OuterState | None = None,
    ) -> None:
        """``step``: the step the run starts after (a resume's); ``outer_state``: DiLoCo's
        checkpoint part, loaded already when the run resumed (else one is made here)."""
        from torchft.local_sgd import DiLoCo, LocalSGD

        self.optimizer = optimizer
        self.algorithm: LocalSGD | DiLoCo
        if ft.semi_sync == "diloco":
            outer = outer_state or OuterState(ft, model_parts)
            # one fragment: this rank's whole share
            self.algorithm = DiLoCo(
                manager, [outer.model], optimizer, outer.optimizer, ft.sync_every
            )
            outer.attach(self.algorithm._fragments[0].original_parameters, step)
        else:
            self.algorithm = LocalSGD(manager, nn.ModuleList(model_parts), optimizer, ft.sync_every)
        # inner steps since the last sync: the groups sync at the multiples of sync_every
        self.algorithm._local_step = step % ft.sync_every

    def after_inner_step(self) -> bool:
        """Count the inner step; at the sync_every-th, sync the groups (a quorum, then the
        parameter or pseudo-gradient all-reduce and, if it commits, the update). Whether this
        step synced."""
        self.algorithm._step_post_hook(self.optimizer, (), {})
        return self.algorithm._local_step == 0
