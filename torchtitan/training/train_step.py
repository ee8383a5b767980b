"""One training step (docs/architecture.md, section 3, "one step"): draw the microbatches,
compute the step's global-token loss scale, run forward and backward per microbatch (the
``MicrobatchRunner``), measure the gradient norm, then step the optimizer unless the non-finite
guard or the loss-spike policy says otherwise; and the rollback a spike may ask for.

``TrainStep`` is constructed by the Trainer with every collaborator it uses, and owns the state
that lives from step to step (the data iterator and its position, a pending rollback).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from torchtitan.checkpoint.manager import CheckpointManager
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.fault_tolerance.replica import ReplicaGroup
from torchtitan.guards.nonfinite import NonFiniteGuard
from torchtitan.guards.spikes import StepGuard
from torchtitan.loss.cross_entropy import global_loss_scale, unmasked_tokens
from torchtitan.metrics.processor import MetricsProcessor
from torchtitan.models.spec import NO_HOOKS, FamilyHooks
from torchtitan.tools.fault_injection import Faults
from torchtitan.tools.logging import logger
from torchtitan.training.microbatch import Batch, MicrobatchRunner


@dataclass
class TrainStep:
    """One optimizer step over ``grad_accum_steps`` microbatches, and what it needs."""

    runner: MicrobatchRunner
    optimizer: torch.optim.Optimizer
    lr_scheduler: LambdaLR
    dataloader: Iterable
    metrics: MetricsProcessor
    nonfinite: NonFiniteGuard
    step_guard: StepGuard
    faults: Faults
    checkpointer: CheckpointManager | None
    grad_accum_steps: int
    max_norm: float  # training.max_norm; 0 measures the norm without clipping
    microbatches_drawn: int = 0  # position in this rank's data stream, for spike reports
    family: FamilyHooks = NO_HOOKS  # the model family's (after_optimizer_step)
    rollback_pending: bool = False
    replicas: ReplicaGroup | None = None  # torchft replica groups (docs/fault_tolerance.md)
    data_iter: Iterator | None = field(default=None, init=False)

    @property
    def parallel_dims(self) -> ParallelDims:
        return self.runner.parallel_dims

    def next_batch(self) -> Batch:
        """The next microbatch on the device: inputs, labels and the model's extra inputs
        (document ids and positions under block_causal)."""
        start = time.perf_counter()
        self.faults.before_batch()
        if self.data_iter is None:
            self.data_iter = iter(self.dataloader)
        batch = next(self.data_iter)
        self.microbatches_drawn += 1
        self.metrics.add_data_time(time.perf_counter() - start)
        device = self.runner.device
        if isinstance(batch, dict):  # image-text samples (data/vlm_dataset.py; docs/vlm.md)
            # the model's image inputs from the whole batch, on the host (positions walk the
            # tokens), before pipeline microbatches and context parallel split them
            images = self.runner.image_inputs(
                batch["inputs"], batch["pixel_values"], batch["grid_thw"]
            )
            inputs, labels = (batch[k].to(device, non_blocking=True) for k in ("inputs", "labels"))
            extra = self.runner.model_inputs(inputs, None)
            extra.update({k: t.to(device, non_blocking=True) for k, t in images.items()})
            return inputs, labels, extra
        inputs, labels, *rest = (t.to(device, non_blocking=True) for t in batch)
        return inputs, labels, self.runner.model_inputs(inputs, rest[0] if rest else None)

    def loss_scale(self, labels: list[torch.Tensor]) -> torch.Tensor:
        """Global token normalisation (docs/sft.md): the ranks averaging gradients and logged
        losses (data x context parallel) over the unmasked tokens of the global batch (these
        microbatches, whole sequences, summed over the data-parallel ranks)."""
        dims = self.parallel_dims
        tokens = unmasked_tokens(labels, dims.get_mesh("dp") if dims.dp_degree > 1 else None)
        return global_loss_scale(tokens, dims.get_mesh("dp_cp").size())

    def run(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Step ``step``: returns its (loss, grad norm) as device scalars."""
        self.optimizer.zero_grad(set_to_none=True)
        step_loss = torch.zeros((), device=self.runner.device)
        for _ in range(self.step_guard.batches_to_skip(step)):
            self.next_batch()  # the batches of this step that spiked before a rollback
        batches = [self.next_batch() for _ in range(self.grad_accum_steps)]
        self.runner.loss.scale = self.loss_scale([labels for _, labels, _ in batches])
        for batch in batches:
            step_loss += self.runner.forward_backward(batch, self.faults.loss_factor(step))
        params = [p for part in self.runner.model_parts for p in part.parameters()]
        if self.replicas is not None and not self.replicas.reduce_and_commit(params):
            return step_loss, torch.zeros((), device=self.runner.device)  # discarded: redone
        # Measure the norm (max_norm 0), check it, then clip: clipping by a NaN norm would make
        # every gradient NaN and hide the parameter where the NaN appeared.
        dims = self.parallel_dims
        grad_norm = dist_utils.clip_grad_norm_(
            params, 0.0, pp_mesh=dims.get_mesh("pp") if dims.pp_enabled else None
        )
        self._update(step, step_loss, grad_norm, params)
        self.lr_scheduler.step()
        if self.replicas is not None:  # semi_sync: every sync_every steps the groups sync
            self.replicas.after_update(step)
        return step_loss, grad_norm

    def _update(
        self,
        step: int,
        step_loss: torch.Tensor,
        grad_norm: torch.Tensor,
        params: list[nn.Parameter],
    ) -> None:
        """The optimizer step, unless the non-finite guard or the spike policy says otherwise:
        a NaN/inf loss or norm raises or (skip_step) keeps the weights and optimizer state; a
        loss spike warns, skips the step, or asks the loop for a rollback."""
        parts = self.runner.model_parts
        if not self.nonfinite.check(step, step_loss, grad_norm, parts):
            self.metrics.skipped_steps = self.nonfinite.skipped_steps
            self.step_guard.skipped(step, "non-finite values", parts)
            return
        verdict = self.step_guard.check(step, self.nonfinite.last_loss, self._batch_position())
        if verdict == "skip":
            self.step_guard.skipped(step, "loss spike", parts)
        elif verdict == "rollback":
            self.rollback_pending = True
        else:
            if self.max_norm > 0:
                dist_utils.clip_grads_with_norm_(params, self.max_norm, grad_norm)
            self.optimizer.step()
            self.family.after_optimizer_step(parts, self.parallel_dims.get_mesh("dp_cp"))
            self.step_guard.stepped()

    def _batch_position(self) -> str:
        a, n = self.grad_accum_steps, self.microbatches_drawn
        dp = self.parallel_dims.get_mesh("dp").get_local_rank()
        return f"microbatches {n - a}..{n - 1} of data-parallel rank {dp}'s stream"

    def rollback(self, bad: int) -> int | None:
        """After a loss spike at step ``bad``: reload the newest checkpoint before it and return
        its step; ``None`` (the step then counts as skipped) when there is none yet."""
        self.rollback_pending = False
        resumed = self.checkpointer.rollback(before=bad) if self.checkpointer else None
        if resumed is None:
            logger.warning(f"loss spike at step {bad}: no checkpoint to roll back to; skipped")
            self.step_guard.skipped(bad, "loss spike, no checkpoint yet", self.runner.model_parts)
            return None
        step = resumed["step"]
        self.data_iter = None
        self.step_guard.rolled_back(bad, step, self.grad_accum_steps)
        self.microbatches_drawn = step * self.grad_accum_steps
        logger.warning(f"rolled back to step {step}; step {bad}'s batches will be skipped")
        return step
