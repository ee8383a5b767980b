"""Token-level cross-entropy (computed in fp32 whatever the logits' dtype)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every token of the (micro)batch; logits [B, S, V], labels [B, S]."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))
