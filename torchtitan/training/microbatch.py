"""Forward and backward of one microbatch (docs/architecture.md, section 3, "one step"): through
the pipeline schedule under PP, on this rank's share of every sequence under CP, inside the
autocast and loss-parallel contexts the layout needs; and the forward-only pass validation uses.

``MicrobatchRunner`` holds exactly what that needs, passed by the Trainer when the model is
built; ``ScaledLoss`` is the training loss with the step's global-token scale, one object shared
by the pipeline schedule and the step that sets the scale.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor.parallel import loss_parallel

from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.context_parallel import ContextParallel
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.pipeline_parallel import Pipeline
from torchtitan.loss.cross_entropy import unmasked_tokens
from torchtitan.models.common.attention import document_positions
from torchtitan.models.spec import batch_inputs, image_inputs

ModelInputs = dict[str, torch.Tensor]
"""Keyword inputs of the model's forward beyond the tokens (``doc_ids``, ``positions``)."""

Batch = tuple[torch.Tensor, torch.Tensor, ModelInputs]
"""A microbatch on the device: inputs, labels and the model's extra inputs."""


class ScaledLoss:
    """``loss_fn(logits, labels) * scale``: the summed token loss times the step's global-token
    scale (docs/sft.md, "Loss normalisation"), so accumulated gradients are the global-batch
    mean. The step sets ``scale`` before its forwards (a device scalar: no host sync); the
    pipeline schedule calls this object for every microbatch of the last stage."""

    def __init__(self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        self.loss_fn = loss_fn
        self.scale: torch.Tensor | float = 1.0

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(logits, labels) * self.scale


@dataclass
class MicrobatchRunner:
    """Runs one microbatch's forward (and backward) on this rank's model parts."""

    model_parts: list[nn.Module]
    loss: ScaledLoss
    pipeline: Pipeline | None
    cp: ContextParallel | None
    parallel_dims: ParallelDims
    device: torch.device
    param_dtype: torch.dtype
    loss_parallel: bool  # TP with loss parallel on: cross-entropy on vocabulary-sharded logits
    document_positions: bool  # training.document_positions: per-document RoPE positions

    def model_inputs(self, inputs: torch.Tensor, doc_ids: torch.Tensor | None) -> ModelInputs:
        """Keyword inputs of the model's forward for a batch, all made from whole sequences
        before CP shards them: ``doc_ids`` under block_causal, and per-document RoPE
        ``positions`` with ``training.document_positions``; and what a model part's
        ``batch_inputs(inputs)`` adds (DeepSeek-V3's multi-token prediction: its shifted
        tokens, which under PP reach every stage this way)."""
        extra: ModelInputs = {}
        if doc_ids is not None:
            extra["doc_ids"] = doc_ids
            if self.document_positions:
                extra["positions"] = document_positions(doc_ids)
        for part in self.model_parts:
            extra.update(batch_inputs(part, inputs))
        return extra

    def image_inputs(
        self, inputs: torch.Tensor, pixel_values: torch.Tensor, grid_thw: torch.Tensor
    ) -> ModelInputs:
        """An image batch's keyword inputs as the model wants them (``spec.image_inputs``),
        from whole sequences (every part of a model gives the same); under PP each one must
        split along the batch into the schedule's microbatches."""
        pipelined = self.pipeline is not None
        return image_inputs(self.model_parts[0], inputs, pixel_values, grid_thw, pipelined)

    def train_context(self) -> contextlib.ExitStack:
        """Contexts around forward, loss and backward: autocast where no FSDP/DDP policy casts
        parameters; loss parallel under TP (whose backward must run inside the context too)."""
        stack = contextlib.ExitStack()
        dims = self.parallel_dims
        if self.param_dtype != torch.float32 and not (dims.fsdp_enabled or dims.ddp_enabled):
            stack.enter_context(torch.autocast(self.device.type, dtype=self.param_dtype))
        if self.loss_parallel:
            stack.enter_context(loss_parallel())
        return stack

    def sequence_share(
        self, batch: Batch
    ) -> contextlib.AbstractContextManager[tuple[torch.Tensor, torch.Tensor, ModelInputs]]:
        """A context around forward (and backward) yielding the batch this rank computes on:
        the whole batch, or under context parallel its share of every sequence."""
        if self.cp is None:
            return contextlib.nullcontext(batch)
        return self.cp.batch(*batch)

    def forward_backward(self, batch: Batch, loss_factor: float = 1.0) -> torch.Tensor:
        """Forward, loss and backward of one microbatch; returns the detached, scaled loss.
        ``loss_factor`` multiplies the loss (1.0 unless a test injects a spike)."""
        with self.train_context(), self.sequence_share(batch) as (inputs, labels, extra):
            if self.pipeline is not None:
                # torch splits the tensors in ``extra`` into microbatches and gives every
                # stage its microbatch's share (docs/attention.md).
                loss = self.pipeline.step(inputs, labels, **extra)
                # Only the last stage has a loss. Elsewhere this zero stays in the rank's running
                # sum and is never shown: at log steps the metrics take the last stage's values.
                if loss is None:
                    return torch.zeros((), device=self.device)
                return dist_utils.local_tensor(loss)
            logits = self.model_parts[0](inputs, **extra)
            loss = self.loss(logits, labels) * loss_factor
            del logits
            loss.backward()
        # Under loss parallel the loss is a replicated DTensor: keep its (full) local value.
        return dist_utils.local_tensor(loss.detach())

    def validation_loss(
        self, inputs: torch.Tensor, labels: torch.Tensor, doc_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, int] | None:
        """Summed token loss and token count of one validation batch, forward only (the
        Validator's hook). Under PP only the last stage has a loss: ``None`` elsewhere."""
        self.loss.scale = 1.0  # plain sums (the next training step sets its own scale)
        batch = (inputs, labels, self.model_inputs(inputs, doc_ids))
        with self.train_context(), self.sequence_share(batch) as (inputs, labels, extra):
            n = int(unmasked_tokens([labels], None))  # this rank's tokens (its share under CP)
            if self.pipeline is not None:
                # Forward-only run of the same schedule: the sum of the microbatches' sums.
                summed = self.pipeline.eval(inputs, labels, **extra)
                if summed is None:
                    return None
                return dist_utils.local_tensor(summed), n
            loss = self.loss.loss_fn(self.model_parts[0](inputs, **extra), labels)
        return dist_utils.local_tensor(loss.detach()), n
