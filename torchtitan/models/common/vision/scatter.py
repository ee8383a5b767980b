"""The placeholder scatter as a module (docs/vlm.md, "Parallelism"), so a parallel plan can
place its output: ``VisualScatter()(h, placeholders, visual)`` is ``scatter_visual`` when there
are image tokens, ``h`` unchanged when there are none (a text-only batch).

Under tensor parallel with sequence parallel, the family's plan has the token embedding return
whole (replicated) rows, the scatter write the image tokens into them, and this module's output
cut onto the sequence shard the first block expects (``PrepareModuleOutput``: a local slice in
the forward, an all-gather of the gradient in the backward)."""

from __future__ import annotations

import torch
from torch import nn

from torchtitan.models.common.vision.positions import scatter_visual


class VisualScatter(nn.Module):
    """No parameters: ``forward(h [B, S, D], placeholders [B, S] bool, visual [N, D] or None)``."""

    def forward(
        self, h: torch.Tensor, placeholders: torch.Tensor, visual: torch.Tensor | None
    ) -> torch.Tensor:
        return h if visual is None else scatter_visual(h, placeholders, visual)
