"""Qwen3.5 with vision as a plain ``nn.Module`` (docs/vlm.md): the Qwen3.5 decoder
(``models/qwen3_5/model.py``) plus ``visual``, the shared vision tower
(``models/common/vision/``). The tower's merged image tokens replace the embeddings of the
placeholder tokens; every full-attention layer rotates by MRoPE (time, height and width
positions; for text all three are the token's index, so a text-only batch is plain RoPE)."""

from __future__ import annotations

import torch

from torchtitan.distributed.init_weights import ParamInit
from torchtitan.models.common.attention import build_attention_mask
from torchtitan.models.common.kv_cache import KVCache
from torchtitan.models.common.vision import VisionTower, mrope_freqs
from torchtitan.models.common.vision import mrope_positions as mrope_positions_of
from torchtitan.models.common.vision.images import VisualScatter, embed_with_images
from torchtitan.models.common.vision.tower import vision_init
from torchtitan.models.qwen3_5.model import Qwen35Transformer
from torchtitan.models.qwen3_5_vl.args import Qwen35VLArgs
from torchtitan.models.qwen3_5_vl.images import per_sample_images

VISUAL = "visual."


class Qwen35VLModel(Qwen35Transformer):
    """``forward(tokens, pixel_values=, grid_thw=)``: logits ``[B, S, vocab]``."""

    args: Qwen35VLArgs
    visual: VisionTower | None  # None on a pipeline stage after the first
    scatter: VisualScatter | None

    def __init__(self, args: Qwen35VLArgs) -> None:
        super().__init__(args)
        self.visual = VisionTower(args.vision)
        self.scatter = VisualScatter()

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        doc_ids: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        grid_thw: torch.Tensor | None = None,
        visual_index: torch.Tensor | None = None,
        mrope_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``tokens`` ``[B, S]`` holding ``image_token_id`` placeholders (hidden states
        ``[B, S, dim]`` on a pipeline stage without the embedding); ``pixel_values``
        ``[N, patch_dim]`` the flattened patches of the ``grid_thw`` (``[images, 3]``) images in
        the order their placeholders appear (row by row), or the per-sample form with
        ``visual_index`` and ``mrope_positions`` (``images.py``) that pipeline and context
        parallel split."""
        a = self.args
        if cache is not None:
            raise ValueError("qwen3_5_vl has no generation cache yet (docs/vlm.md)")
        if self.tok_embeddings is None:  # a later pipeline stage: hidden states in
            if pixel_values is not None and mrope_positions is None:
                raise ValueError(
                    "a qwen3_5_vl pipeline stage after the first needs mrope_positions with an "
                    "image batch (images.py: per_sample_images)"
                )
            h = tokens
        else:
            h = self._embed(tokens, pixel_values, grid_thw, visual_index)
        if mrope_positions is not None:  # the whole sequence's, this shard's tokens
            pos3 = mrope_positions.permute(2, 0, 1)
        elif positions is None and tokens.dim() == 2:
            merge = a.vision.spatial_merge_size
            pos3 = mrope_positions_of(tokens, a.image_token_id, grid_thw, merge)
        else:  # text positions (per document, or a stage's arange): the three rows equal
            seq = h.shape[:2]
            text = torch.arange(seq[1], device=h.device) if positions is None else positions
            pos3 = text.expand(seq).unsqueeze(0).expand(3, -1, -1)
        freqs = mrope_freqs(self.freqs_cis, pos3, a.mrope_section)
        mask = None if doc_ids is None else build_attention_mask(doc_ids, a.attn_backend, positions)
        for layer in self.layers.values():
            h = layer(h, freqs, mask=mask)
        return self._head(h, tokens, freqs, mask, None)

    def _embed(
        self,
        tokens: torch.Tensor,
        pixel_values: torch.Tensor | None,
        grid_thw: torch.Tensor | None,
        visual_index: torch.Tensor | None,
    ) -> torch.Tensor:
        """Token embeddings with the tower's merged image tokens at the placeholders (whole rows
        until ``self.scatter``, which tensor parallel cuts onto the sequence shard)."""
        a = self.args
        assert self.tok_embeddings is not None and self.scatter is not None
        assert self.visual is not None
        images = (pixel_values, grid_thw, visual_index)
        merge = a.vision.spatial_merge_size
        return embed_with_images(
            self.tok_embeddings, self.scatter, self.visual, tokens, a.image_token_id, images, merge
        )

    def image_inputs(
        self,
        tokens: torch.Tensor,
        pixel_values: torch.Tensor,
        grid_thw: torch.Tensor,
        microbatched: bool = True,
    ) -> dict[str, torch.Tensor]:
        """A collated image batch's keyword inputs in the per-sample form pipeline and context
        parallel split (``images.py``), from its whole sequences; ``pixel_values`` padded per
        row only when ``microbatched`` (a pipeline schedule splits the batch)."""
        a = self.args
        merge = a.vision.spatial_merge_size
        return per_sample_images(
            tokens, pixel_values, grid_thw, a.image_token_id, merge, microbatched
        )

    def _rule(self, fqn: str) -> ParamInit:
        if fqn.startswith(VISUAL):
            return vision_init(fqn)
        return super()._rule(fqn)
