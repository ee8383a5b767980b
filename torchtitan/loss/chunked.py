"""Chunked linear + cross-entropy: the output projection and the loss over chunks of tokens, so
the full ``[tokens, vocab]`` logits (and their fp32 copy and softmax gradient) never exist
(docs/memory.md).

Each chunk ``hidden[i:i+c] @ weight.T -> cross_entropy(sum)`` runs under
``torch.utils.checkpoint`` (non-reentrant): forward keeps only the chunk's inputs (views of the
hidden states, the weight, the labels), and backward recomputes the chunk's logits, so at most
one chunk's logits are alive at a time. The price is one more forward matmul of the output
projection per step. Checkpointing, rather than a hand-written autograd Function, is chosen
because it runs the same aten ops as the unchunked path: under tensor parallel the weight is a
vocabulary-sharded DTensor and each chunk's logits a ``Shard(-1)`` DTensor, so torch's
``loss_parallel()`` computes the cross-entropy on the shards exactly as it does today, with no
collective written here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.checkpoint import checkpoint

from torchtitan.distributed.output_head import deferred_output

IGNORE_INDEX = -100


def _chunk_loss(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, gather: bool
) -> torch.Tensor:
    logits = F.linear(hidden, weight)
    if gather and isinstance(logits, DTensor):
        logits = logits.redistribute(placements=[Replicate()]).to_local()
    return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int,
    reduction: Literal["mean", "sum"] = "mean",
    gather_logits: bool = False,
) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T`` against ``labels`` (``-100`` ignored), computed
    ``chunk_size`` tokens at a time; equal to
    ``F.cross_entropy(F.linear(hidden, weight).flatten(0, -2).float(), labels.flatten())``.

    ``hidden``: ``[..., dim]`` (a replicated DTensor under tensor parallel); ``weight``:
    ``[vocab, dim]`` (vocabulary-sharded under TP: call inside ``loss_parallel()``, or set
    ``gather_logits`` to all-gather each chunk's logits instead). ``reduction``: ``mean`` over
    the tokens whose label is not ignored (NaN when there are none, as torch's), or ``sum``.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    flat_h = hidden.flatten(0, -2)
    flat_y = labels.flatten()
    total: torch.Tensor | None = None
    for start in range(0, flat_y.numel(), chunk_size):
        end = start + chunk_size
        part = checkpoint(
            _chunk_loss,
            flat_h[start:end],
            weight,
            flat_y[start:end],
            gather_logits,
            use_reentrant=False,
        )
        total = part if total is None else total + part
    assert total is not None, "no tokens"
    if reduction == "sum":
        return total
    count = (flat_y != IGNORE_INDEX).sum()
    if isinstance(total, DTensor):
        return total / count.item()
    return total / count


def build_chunked_loss(
    model_parts: list[nn.Module],
    output_path: str | None,
    chunk_size: int,
    gather_logits: bool,
    reduction: Literal["mean", "sum"] = "mean",
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The trainer's ``loss_fn(hidden, labels)`` (``reduction`` over the tokens) when the
    model's output projection is deferred (``distributed/output_head.py``). It reads the
    projection's weight at each call: under FSDP that is the gathered weight of this forward."""
    head = deferred_output(model_parts, output_path)

    def loss_fn(hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if head is None:
            raise RuntimeError("chunked loss called on a rank without the output projection")
        return chunked_cross_entropy(
            hidden,
            head.weight,
            labels,
            chunk_size,
            reduction=reduction,
            gather_logits=gather_logits,
        )

    return loss_fn
