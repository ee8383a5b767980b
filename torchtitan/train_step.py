"""One training step, the part of the Trainer that runs every iteration (docs/architecture.md,
section 3, "one step"): draw the microbatches, compute the step's global-token loss scale, run
forward and backward per microbatch (through the pipeline schedule under PP, on this rank's
sequence share under CP), measure the gradient norm, then step the optimizer unless the
non-finite guard or the loss-spike policy says otherwise.

``Trainer`` (``trainer.py``) builds what these methods use and owns the loop; ``StepMixin`` only
names those attributes.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import loss_parallel
from torch.optim.lr_scheduler import LambdaLR

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import global_loss_scale, unmasked_tokens
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.nonfinite import NonFiniteGuard
from torchtitan.components.spikes import StepGuard
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.context_parallel import ContextParallel
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.pipeline_parallel import Pipeline
from torchtitan.distributed.pipeline_plan import PipelinePlan
from torchtitan.models.common.attention import document_positions
from torchtitan.models.common.moe import update_expert_bias
from torchtitan.tools.fault_injection import Faults
from torchtitan.tools.logging import logger

ModelInputs = dict[str, torch.Tensor]
"""Keyword inputs of the model's forward beyond the tokens (``doc_ids``, ``positions``)."""


class StepMixin:
    """The per-step methods of ``Trainer``; the attributes below are built by the Trainer."""

    cfg: JobConfig
    device: torch.device
    parallel_dims: ParallelDims
    pp_plan: PipelinePlan | None
    param_dtype: torch.dtype
    model: nn.Module
    model_parts: list[nn.Module]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    loss_scale: torch.Tensor | float
    pipeline: Pipeline | None
    cp: ContextParallel | None
    optimizer: torch.optim.Optimizer
    lr_scheduler: LambdaLR
    dataloader: Any
    data_iter: Iterator | None
    metrics: MetricsProcessor
    nonfinite: NonFiniteGuard
    step_guard: StepGuard
    faults: Faults
    checkpointer: CheckpointManager | None
    grad_accum_steps: int
    microbatches_drawn: int
    rollback_pending: bool
    step: int

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor, ModelInputs]:
        """The next microbatch on the device: inputs, labels and the model's extra inputs
        (document ids and positions under block_causal, see ``model_inputs``)."""
        start = time.perf_counter()
        self.faults.before_batch()
        if self.data_iter is None:
            self.data_iter = iter(self.dataloader)
        batch = next(self.data_iter)
        self.microbatches_drawn += 1
        self.metrics.add_data_time(time.perf_counter() - start)
        inputs, labels, *rest = (t.to(self.device, non_blocking=True) for t in batch)
        return inputs, labels, self.model_inputs(rest[0] if rest else None)

    def model_inputs(self, doc_ids: torch.Tensor | None) -> ModelInputs:
        """Keyword inputs of the model's forward for a batch: none under causal masking;
        ``doc_ids`` under block_causal, and per-document RoPE ``positions`` with
        ``training.document_positions`` (computed on the whole sequence, before CP shards it)."""
        if doc_ids is None:
            return {}
        extra = {"doc_ids": doc_ids}
        if self.cfg.training.document_positions:
            extra["positions"] = document_positions(doc_ids)
        return extra

    def validation_loss(
        self, inputs: torch.Tensor, labels: torch.Tensor, doc_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, int] | None:
        """Summed token loss and token count of one validation batch, forward only (the
        Validator's hook). Under PP only the last stage has a loss: ``None`` elsewhere."""
        extra = self.model_inputs(doc_ids)
        self.loss_scale = 1.0  # plain sums (the next train_step sets its own scale)
        with self.train_context(), self.sequence_share(inputs, labels, extra) as share:
            inputs, labels, extra = share
            n = int(unmasked_tokens([labels], None))  # this rank's tokens (its share under CP)
            if self.pipeline is not None:
                # Forward-only run of the same schedule: the sum of the microbatches' sums.
                summed = self.pipeline.eval(inputs, labels, **extra)
                if summed is None:
                    return None
                return dist_utils.local_tensor(summed), n
            loss = self.loss_fn(self.model(inputs, **extra), labels)
        return dist_utils.local_tensor(loss.detach()), n

    def sequence_share(
        self, inputs: torch.Tensor, labels: torch.Tensor, extra: ModelInputs
    ) -> contextlib.AbstractContextManager[tuple[torch.Tensor, torch.Tensor, ModelInputs]]:
        """A context around forward (and backward) yielding the inputs, labels and extra model
        inputs this rank computes on: the whole batch, or under context parallel its share of
        every sequence."""
        if self.cp is None:
            return contextlib.nullcontext((inputs, labels, extra))
        return self.cp.batch(inputs, labels, extra)

    def train_context(self) -> contextlib.ExitStack:
        """Contexts around forward, loss and backward: autocast where no FSDP/DDP policy casts
        parameters; loss parallel under TP (cross-entropy on vocabulary-sharded logits, whose
        backward must run inside the context too)."""
        stack = contextlib.ExitStack()
        dims = self.parallel_dims
        if self.param_dtype != torch.float32 and not (dims.fsdp_enabled or dims.ddp_enabled):
            stack.enter_context(torch.autocast(self.device.type, dtype=self.param_dtype))
        if dims.tp_enabled and not self.cfg.parallelism.disable_loss_parallel:
            stack.enter_context(loss_parallel())
        return stack

    def pipeline_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Loss of one pipeline microbatch, scaled so the gradients sum to the global-batch mean."""
        assert self.pp_plan is not None
        return self.loss_fn(logits, labels) * self.loss_scale

    def forward_backward(
        self, inputs: torch.Tensor, labels: torch.Tensor, extra: ModelInputs | None = None
    ) -> torch.Tensor:
        """Forward, loss and backward of one microbatch; returns the detached, scaled loss."""
        extra = extra or {}
        if self.pipeline is not None:
            with self.train_context(), self.sequence_share(inputs, labels, extra) as share:
                inputs, labels, extra = share
                # torch splits the tensors in ``extra`` into microbatches and gives every
                # stage its microbatch's share (docs/attention.md).
                loss = self.pipeline.step(inputs, labels, **extra)
            # Only the last stage has a loss. Elsewhere this zero stays in the rank's running sum
            # and is never shown: at log steps the metrics take the last stage's values.
            if loss is None:
                return torch.zeros((), device=self.device)
            return dist_utils.local_tensor(loss)
        with self.train_context(), self.sequence_share(inputs, labels, extra) as share:
            inputs, labels, extra = share
            logits = self.model(inputs, **extra)
            # Scale so the accumulated gradient is the mean over the whole global batch.
            loss = self.loss_fn(logits, labels) * self.loss_scale
            loss = loss * self.faults.loss_factor(self.step)  # 1.0 unless a test injects a spike
            del logits
            loss.backward()
        # Under loss parallel the loss is a replicated DTensor: keep its (full) local value.
        return dist_utils.local_tensor(loss.detach())

    def step_loss_scale(self, labels: list[torch.Tensor]) -> torch.Tensor:
        """Global token normalisation (docs/sft.md): the ranks averaging gradients and logged
        losses (data x context parallel) over the unmasked tokens of the global batch (these
        microbatches, whole sequences, summed over the data-parallel ranks)."""
        dims = self.parallel_dims
        tokens = unmasked_tokens(labels, dims.get_mesh("dp") if dims.dp_degree > 1 else None)
        return global_loss_scale(tokens, dims.get_mesh("dp_cp").size())

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over ``grad_accum_steps`` microbatches; returns (loss, grad norm)."""
        self.optimizer.zero_grad(set_to_none=True)
        step_loss = torch.zeros((), device=self.device)
        for _ in range(self.step_guard.batches_to_skip(self.step)):
            self.next_batch()  # the batches of this step that spiked before a rollback
        batches = [self.next_batch() for _ in range(self.grad_accum_steps)]
        self.loss_scale = self.step_loss_scale([labels for _, labels, _ in batches])
        for inputs, labels, extra in batches:
            step_loss += self.forward_backward(inputs, labels, extra)
        params = [p for part in self.model_parts for p in part.parameters()]
        # Measure the norm (max_norm 0), check it, then clip: clipping by a NaN norm would make
        # every gradient NaN and hide the parameter where the NaN appeared.
        grad_norm = dist_utils.clip_grad_norm_(
            params,
            0.0,
            pp_mesh=self.parallel_dims.get_mesh("pp") if self.parallel_dims.pp_enabled else None,
        )
        self._update(step_loss, grad_norm, params)
        self.lr_scheduler.step()
        return step_loss, grad_norm

    def _update(
        self, step_loss: torch.Tensor, grad_norm: torch.Tensor, params: list[nn.Parameter]
    ) -> None:
        """The optimizer step, unless the non-finite guard or the spike policy says otherwise:
        a NaN/inf loss or norm raises or (skip_step) keeps the weights and optimizer state; a
        loss spike warns, skips the step, or asks ``train`` for a rollback."""
        if not self.nonfinite.check(self.step, step_loss, grad_norm, self.model_parts):
            self.metrics.skipped_steps = self.nonfinite.skipped_steps
            self.step_guard.skipped(self.step, "non-finite values", self.model_parts)
            return
        verdict = self.step_guard.check(self.step, self.nonfinite.last_loss, self._batch_position())
        if verdict == "skip":
            self.step_guard.skipped(self.step, "loss spike", self.model_parts)
        elif verdict == "rollback":
            self.rollback_pending = True
        else:
            if self.cfg.training.max_norm > 0:
                dist_utils.clip_grads_with_norm_(params, self.cfg.training.max_norm, grad_norm)
            self.optimizer.step()
            update_expert_bias(self.model_parts, self.parallel_dims.get_mesh("dp_cp"))  # MoE
            self.step_guard.stepped()

    def _batch_position(self) -> str:
        a, n = self.grad_accum_steps, self.microbatches_drawn
        dp = self.parallel_dims.get_mesh("dp").get_local_rank()
        return f"microbatches {n - a}..{n - 1} of data-parallel rank {dp}'s stream"

    def _rollback(self) -> bool:
        """Reload the newest checkpoint before this step after a loss spike; False (the step
        then counts as skipped) when there is none yet."""
        self.rollback_pending = False
        bad = self.step
        resumed = self.checkpointer.rollback(before=bad) if self.checkpointer else None
        if resumed is None:
            logger.warning(f"loss spike at step {bad}: no checkpoint to roll back to; skipped")
            self.step_guard.skipped(bad, "loss spike, no checkpoint yet", self.model_parts)
            return False
        self.step, self.data_iter = resumed["step"], None
        self.step_guard.rolled_back(bad, self.step, self.grad_accum_steps)
        self.microbatches_drawn = self.step * self.grad_accum_steps
        logger.warning(f"rolled back to step {self.step}; step {bad}'s batches will be skipped")
        return True
