"""Validation: loss and perplexity on a held-out split every ``validation.freq`` steps.

The :class:`Validator` owns a finite (one pass) data loader over the ``validation`` split of the
dataset, sharded like the training data, and runs ``validation.steps`` batches of it (or all of
it with -1) forward-only, under ``torch.no_grad`` with every model part in ``eval()`` mode. The
forward itself is the trainer's ``loss_fn(inputs, labels)``, which returns the *summed* token loss
and the token count of the batch on ranks that compute a loss, and ``None`` on ranks that do not
(pipeline stages other than the last). That is the hook through which every parallelism runs
validation exactly as it trains: TP/CP/FSDP need nothing more than the trainer's own forward;
pipeline parallel passes a forward-only schedule run.

Reduction: the (loss sum, token count) pair is summed over ``loss_mesh`` (the data-parallel and
context-parallel ranks, which hold different tokens) and then over ``pp_mesh`` (where only the
last stage contributes), so every rank logs the same mean loss; perplexity is ``exp(loss)``.
Ranks must run the same number of batches (their collectives pair up): before each batch the
data-parallel ranks agree, with a MIN over ``dp_mesh``, that all of them still have one. Only
full batches count (a partial last batch is dropped: pipeline microbatches need full ones), so
the validation data is the same at every data-parallel degree with window sharding.

Scalars go to every writer under ``validation/loss``, ``validation/perplexity``,
``validation/tokens`` and ``validation/time_s``, in their own record at the validation step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.config.sections import Validation
from torchtitan.data.checks import DataError
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.utils import all_reduce_
from torchtitan.metrics.writers import MetricWriter
from torchtitan.tools.logging import logger

__all__ = ["LossFn", "Validator", "build_validator"]

LossFn = Callable[..., "tuple[torch.Tensor, int] | None"]
"""(inputs, labels[, doc_ids]) -> (summed token loss, token count), or None on ranks without a
loss; it gets every tensor of the batch, in the loader's order."""


def _size(mesh: DeviceMesh | None) -> int:
    return 1 if mesh is None else mesh.size()


class Validator:
    def __init__(
        self,
        *,
        dataloader: Iterable[tuple[torch.Tensor, ...]],
        freq: int,
        steps: int,
        loss_fn: LossFn,
        batch_size: int,
        model_parts: Sequence[nn.Module],
        device: torch.device,
        writers: Sequence[MetricWriter] = (),
        dp_mesh: DeviceMesh | None = None,
        loss_mesh: DeviceMesh | None = None,
        pp_mesh: DeviceMesh | None = None,
    ) -> None:
        self.dataloader = dataloader
        self.freq = freq
        self.steps = steps
        self.loss_fn = loss_fn
        self.batch_size = batch_size
        self.model_parts = list(model_parts)
        self.device = device
        self.writers = list(writers)
        self.dp_mesh = dp_mesh if _size(dp_mesh) > 1 else None
        self.loss_mesh = loss_mesh if _size(loss_mesh) > 1 else None
        self.pp_mesh = pp_mesh if _size(pp_mesh) > 1 else None

    def should_validate(self, step: int) -> bool:
        return step % self.freq == 0

    def _all_have_batch(self, has: bool) -> bool:
        if self.dp_mesh is None:
            return has
        flag = torch.tensor([1.0 if has else 0.0], device=self.device)
        all_reduce_(flag, self.dp_mesh, op="min")
        return bool(flag.item() > 0)

    def _batches(self) -> Iterator[tuple[torch.Tensor, ...]]:
        it = iter(self.dataloader)  # a fresh pass from the start of the split
        n = 0
        while self.steps < 0 or n < self.steps:
            batch = next(it, None)
            if batch is not None and batch[0].shape[0] != self.batch_size:
                batch = None  # a partial last batch is dropped (microbatches need full ones)
            if not self._all_have_batch(batch is not None):
                return
            assert batch is not None
            n += 1
            yield tuple(t.to(self.device) for t in batch)

    @torch.no_grad()
    def validate(self, step: int) -> dict[str, float]:
        """Run one validation; log one line and write the scalars. Returns them."""
        start = time.perf_counter()
        was_training = [m.training for m in self.model_parts]
        for m in self.model_parts:
            m.eval()
        # float64 accumulators on the host side of the device: exact token counts, no drift.
        acc = torch.zeros(2, dtype=torch.float64, device=self.device)
        batches = 0
        try:
            for batch in self._batches():
                out = self.loss_fn(*batch)
                batches += 1
                if out is not None:
                    loss_sum, tokens = out
                    acc[0] += loss_sum.detach().to(torch.float64).reshape(())
                    acc[1] += tokens
        finally:
            for m, mode in zip(self.model_parts, was_training):
                m.train(mode)
        all_reduce_(acc, self.loss_mesh, op="sum")
        all_reduce_(acc, self.pp_mesh, op="sum")
        loss_sum, tokens = acc.tolist()
        if tokens == 0:
            src = getattr(getattr(self.dataloader, "dataset", None), "source", None)
            raise DataError(
                src.field if src is not None else "validation.dataset",
                src.value if src is not None else None,
                "the validation split is empty or shorter than one batch of "
                "training.local_batch_size sequences of training.seq_len + 1 tokens per "
                "data-parallel rank",
                "give more validation data, or lower training.local_batch_size / seq_len",
            )
        loss = loss_sum / tokens
        ppl = math.exp(loss) if loss < 700 else math.inf
        elapsed = time.perf_counter() - start
        logger.info(
            f"validation step {step:>6}  loss {loss:8.4f}  perplexity {ppl:10.3f}  "
            f"({batches} batches, {int(tokens):,} tokens over all ranks, {elapsed:.1f} s)"
        )
        metrics: dict[str, float] = {
            "validation/loss": loss,
            "validation/perplexity": ppl,
            "validation/tokens": tokens,
            "validation/time_s": elapsed,
        }
        for w in self.writers:
            w.log(dict(metrics), step)
        return metrics


def build_validator(
    v: Validation,
    loader: Iterable[tuple[torch.Tensor, ...]],
    dims: ParallelDims,
    *,
    loss_fn: LossFn,
    batch_size: int,
    model_parts: Sequence[nn.Module],
    device: torch.device,
    writers: Sequence[MetricWriter],
) -> Validator:
    """The validation loss of ``[validation]`` over ``loader`` (this rank's, one pass) in a
    layout ``dims`` (docs/observability.md)."""
    return Validator(
        dataloader=loader,
        freq=v.freq,
        steps=v.steps,
        loss_fn=loss_fn,
        batch_size=batch_size,
        model_parts=model_parts,
        device=device,
        writers=writers,
        dp_mesh=dims.get_mesh("dp"),
        loss_mesh=dims.get_mesh("dp_cp"),
        pp_mesh=dims.get_mesh("pp") if dims.pp_enabled else None,
    )
