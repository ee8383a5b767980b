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
from torchtitan.models.common.vision import (
    VisionTower,
    mrope_freqs,
    mrope_positions,
)
from torchtitan.models.common.vision.scatter import VisualScatter
from torchtitan.models.common.vision.tower import vision_init
from torchtitan.models.qwen3_5.model import Qwen35Transformer
from torchtitan.models.qwen3_5_vl.args import Qwen35VLArgs

VISUAL = "visual."


class Qwen35VLModel(Qwen35Transformer):
    """``forward(tokens, pixel_values=, grid_thw=)``: logits ``[B, S, vocab]``."""

    args: Qwen35VLArgs

    def __init__(self, args: Qwen35VLArgs) -> None:
        super().__init__(args)
        self.visual = VisionTower(args.vision)
        self.scatter = VisualScatter()  # a module: tensor parallel places its output

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        doc_ids: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        grid_thw: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``tokens`` ``[B, S]`` holding ``image_token_id`` placeholders; ``pixel_values``
        ``[N, patch_dim]`` the flattened patches of the ``grid_thw`` (``[images, 3]``) images in
        the order their placeholders appear (row by row)."""
        a = self.args
        if cache is not None or self.tok_embeddings is None or tokens.dim() != 2:
            raise ValueError(
                "qwen3_5_vl runs whole models on token ids (no pipeline stage, no generation "
                "cache; docs/vlm.md)"
            )
        placeholders = tokens == a.image_token_id
        visual = None
        if pixel_values is not None:
            if grid_thw is None:
                raise ValueError("pixel_values given without grid_thw")
            visual = self.visual(pixel_values, grid_thw)
        elif bool(placeholders.any()):
            raise ValueError(
                f"{int(placeholders.sum())} image placeholder tokens (id {a.image_token_id}) "
                "but no pixel_values"
            )
        # whole rows here; under tensor parallel the scatter's output is cut onto the sequence
        # shard (parallel_plan.py)
        h = self.scatter(self.tok_embeddings(tokens), placeholders, visual)
        if positions is None:
            merge = a.vision.spatial_merge_size
            pos3 = mrope_positions(tokens, a.image_token_id, grid_thw, merge)
        else:  # text positions (per document): the three rows equal
            pos3 = positions.expand(tokens.shape).unsqueeze(0).expand(3, -1, -1)
        freqs = mrope_freqs(self.freqs_cis, pos3, a.mrope_section)
        mask = None if doc_ids is None else build_attention_mask(doc_ids, a.attn_backend, positions)
        for layer in self.layers.values():
            h = layer(h, freqs, mask=mask)
        return self._head(h, tokens, freqs, mask, None)

    def _rule(self, fqn: str) -> ParamInit:
        if fqn.startswith(VISUAL):
            return vision_init(fqn)
        return super()._rule(fqn)
