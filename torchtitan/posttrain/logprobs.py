"""Per-token and per-sequence log-probabilities of labelled tokens (docs/posttrain.md).

Labels follow the training batches' convention (``loss/cross_entropy.py``): ``labels[b, t]`` is
the token after ``inputs[b, t]``, ``IGNORE_INDEX`` where it does not count (the prompt, padding).
Computed in fp32 whatever the logits' dtype. Under tensor parallel the logits arrive sharded over
the vocabulary (a ``DTensor``): they are gathered first (a post-training batch is small next to
pretraining; loss parallel's fused cross-entropy has no per-token output).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from torchtitan.loss.cross_entropy import IGNORE_INDEX


def full_logits(logits: torch.Tensor) -> torch.Tensor:
    """The whole logits as a plain tensor (a vocabulary-sharded DTensor gathered)."""
    return logits.full_tensor() if isinstance(logits, DTensor) else logits


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``log p(labels[b, t])`` ``[B, S]`` in fp32; 0 where the label is ``IGNORE_INDEX``."""
    logits = full_logits(logits).float()
    lp = -F.cross_entropy(
        logits.flatten(0, 1), labels.flatten(0, 1), ignore_index=IGNORE_INDEX, reduction="none"
    )
    return lp.view(labels.shape)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of each position's next-token distribution ``[B, S]`` (no gradient)."""
    with torch.no_grad():
        logp = torch.log_softmax(full_logits(logits).float(), dim=-1)
        return -(logp.exp() * logp).sum(-1)


def sequence_logprobs(
    logits: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-prob of each row's labelled tokens ``[B]`` and their count ``[B]`` (fp32)."""
    mask = labels != IGNORE_INDEX
    return token_logprobs(logits, labels).sum(-1), mask.sum(-1).float()
