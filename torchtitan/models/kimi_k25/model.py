"""Kimi K2.5 as a plain ``nn.Module`` (docs/vlm.md, "Kimi K2.5"): the DeepSeek-V3 decoder
(``models/deepseek_v3/model.py``) plus ``vision_tower`` (MoonViT) and ``mm_projector``
(``models/common/vision/moonvit.py``). The projected image tokens replace the embeddings of the
placeholder tokens; the decoder's RoPE is its plain 1-D one (no multimodal positions)."""

from __future__ import annotations

import torch
from torch import nn

from torchtitan.distributed.init_weights import ParamInit
from torchtitan.models.common.kv_cache import KVCache
from torchtitan.models.common.vision import scatter_visual
from torchtitan.models.common.vision.moonvit import MoonViT, Projector, moonvit_init
from torchtitan.models.deepseek_v3.model import Transformer
from torchtitan.models.kimi_k25.args import KimiK25Args

VISUAL = ("vision_tower.", "mm_projector.")


class VisualScatter(nn.Module):
    """The projected image tokens written over the placeholders' embeddings (``h`` unchanged
    without images). A module, with no parameters, so the parallel plan can place its output:
    under tensor parallel its whole rows are cut onto the sequence shard the first block
    expects (``parallel_plan.py``)."""

    def forward(
        self, h: torch.Tensor, placeholders: torch.Tensor, visual: torch.Tensor | None
    ) -> torch.Tensor:
        return h if visual is None else scatter_visual(h, placeholders, visual)


class KimiK25Model(Transformer):
    """``forward(tokens, pixel_values=, grid_thw=)``: logits ``[B, S, vocab]``."""

    args: KimiK25Args

    def __init__(self, args: KimiK25Args) -> None:
        super().__init__(args)
        self.vision_tower = MoonViT(args.vision)
        self.mm_projector = Projector(args.vision)
        self.scatter = VisualScatter()

    def image_tokens(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """``[M, dim]``: the merged, projected tokens of the ``grid_thw`` images in order."""
        return self.mm_projector(self.vision_tower(pixel_values, grid_thw))

    def forward(  # type: ignore[override]
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        doc_ids: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        grid_thw: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``tokens`` ``[B, S]`` holding ``image_token_id`` placeholders; ``pixel_values``
        ``[N, 3 * P * P]`` the patches of the ``grid_thw`` (``[images, 3]``) images in the
        order their placeholders appear (row by row)."""
        a = self.args
        if cache is not None or self.tok_embeddings is None or self.output is None:
            raise ValueError(
                "kimi_k25 runs whole models on token ids (no pipeline stage, no generation "
                "cache; docs/vlm.md)"
            )
        placeholders = tokens == a.image_token_id
        visual = None
        if pixel_values is not None:
            if grid_thw is None:
                raise ValueError("pixel_values given without grid_thw")
            visual = self.image_tokens(pixel_values, grid_thw)
        elif bool(placeholders.any()):
            raise ValueError(
                f"{int(placeholders.sum())} image placeholder tokens (id {a.image_token_id}) "
                "but no pixel_values"
            )
        h = self.scatter(self.tok_embeddings(tokens), placeholders, visual)
        h, freqs_cis, mask = self.run_blocks(h, positions, doc_ids, None)
        self.mtp_loss = None  # mtp_depth is 0 (args.py)
        return self._head(h, tokens, freqs_cis, mask, None)

    def _rule(self, fqn: str) -> ParamInit:
        if fqn.startswith(VISUAL):
            return moonvit_init(fqn)
        return super()._rule(fqn)
