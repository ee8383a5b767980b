"""Kimi K2.5 as a plain ``nn.Module`` (docs/vlm.md, "Kimi K2.5"): the DeepSeek-V3 decoder
(``models/deepseek_v3/model.py``) plus ``vision_tower`` (MoonViT) and ``mm_projector``
(``models/common/vision/moonvit.py``). The projected image tokens replace the embeddings of the
placeholder tokens; the decoder's RoPE is its plain 1-D one (no multimodal positions)."""

from __future__ import annotations

import torch

from torchtitan.distributed.init_weights import ParamInit
from torchtitan.models.common.kv_cache import KVCache
from torchtitan.models.common.vision.images import (
    VisualScatter,
    embed_with_images,
    per_sample_images,
)
from torchtitan.models.common.vision.moonvit import MoonViT, Projector, moonvit_init
from torchtitan.models.deepseek_v3.model import Transformer
from torchtitan.models.kimi_k25.args import KimiK25Args

VISUAL = ("vision_tower.", "mm_projector.")


class KimiK25Model(Transformer):
    """``forward(tokens, pixel_values=, grid_thw=)``: logits ``[B, S, vocab]``."""

    args: KimiK25Args
    vision_tower: MoonViT | None  # None on a pipeline stage after the first
    mm_projector: Projector | None
    scatter: VisualScatter | None

    def __init__(self, args: KimiK25Args) -> None:
        super().__init__(args)
        self.vision_tower = MoonViT(args.vision)
        self.mm_projector = Projector(args.vision)
        self.scatter = VisualScatter()

    def image_tokens(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """``[M, dim]``: the merged, projected tokens of the ``grid_thw`` images in order."""
        assert self.vision_tower is not None and self.mm_projector is not None
        return self.mm_projector(self.vision_tower(pixel_values, grid_thw))

    def forward(  # type: ignore[override]
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        doc_ids: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        grid_thw: torch.Tensor | None = None,
        visual_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``tokens`` ``[B, S]`` holding ``image_token_id`` placeholders (hidden states
        ``[B, S, dim]`` on a pipeline stage without the embedding); ``pixel_values``
        ``[N, 3 * P * P]`` the patches of the ``grid_thw`` (``[images, 3]``) images in the
        order their placeholders appear (row by row), or the per-sample form with
        ``visual_index`` (``image_inputs``) that pipeline and context parallel split."""
        if cache is not None:
            raise ValueError("kimi_k25 has no generation cache yet (docs/vlm.md)")
        if self.tok_embeddings is None:  # a later pipeline stage: hidden states in
            h = tokens
        else:
            h = self._embed(tokens, pixel_values, grid_thw, visual_index)
        h, freqs_cis, mask = self.run_blocks(h, positions, doc_ids, None)
        self.mtp_loss = None  # mtp_depth is 0 (args.py)
        if self.output is None:  # a pipeline stage before the last
            return h
        return self._head(h, tokens, freqs_cis, mask, None)

    def _embed(
        self,
        tokens: torch.Tensor,
        pixel_values: torch.Tensor | None,
        grid_thw: torch.Tensor | None,
        visual_index: torch.Tensor | None,
    ) -> torch.Tensor:
        """Token embeddings with the projected image tokens at the placeholders (whole rows
        until ``self.scatter``, which tensor parallel cuts onto the sequence shard)."""
        a = self.args
        assert self.tok_embeddings is not None and self.scatter is not None
        images = (pixel_values, grid_thw, visual_index)
        merge = a.vision.spatial_merge_size
        return embed_with_images(
            self.tok_embeddings,
            self.scatter,
            self.image_tokens,
            tokens,
            a.image_token_id,
            images,
            merge,
            True,
        )

    def image_inputs(
        self,
        tokens: torch.Tensor,
        pixel_values: torch.Tensor,
        grid_thw: torch.Tensor,
        microbatched: bool = True,
    ) -> dict[str, torch.Tensor]:
        """A collated image batch's keyword inputs in the per-sample form pipeline and context
        parallel split (``models/common/vision/images.py``; a clip's frames pooled into one set
        of merged tokens), from its whole sequences; ``pixel_values`` padded per row only when
        ``microbatched`` (a pipeline schedule splits the batch)."""
        a = self.args
        return per_sample_images(
            tokens,
            pixel_values,
            grid_thw,
            a.image_token_id,
            a.vision.spatial_merge_size,
            microbatched,
            pool_frames=True,
        )

    def _rule(self, fqn: str) -> ParamInit:
        if fqn.startswith(VISUAL):
            return moonvit_init(fqn)
        return super()._rule(fqn)
