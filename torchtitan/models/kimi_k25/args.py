"""Kimi K2.5 (``Kimi_K25ForConditionalGeneration``; docs/vlm.md, "Kimi K2.5"): DeepSeek-V3's
decoder args (``models/deepseek_v3/args.py``) plus the MoonViT tower's shape
(``models/common/vision/moonvit.py``) and the image placeholder token."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from torchtitan.config.errors import ConfigError
from torchtitan.models.common.moe import MoEArgs
from torchtitan.models.common.vision.moonvit import MoonViTArgs
from torchtitan.models.deepseek_v3.args import (
    DEEPSEEK_V3_FLAVORS,
    DeepSeekV3Args,
    group_routed_experts,
)


@dataclass
class KimiK25Args(DeepSeekV3Args):
    """A DeepSeek-V3 decoder fed by a MoonViT tower."""

    vision: MoonViTArgs = field(default_factory=MoonViTArgs)
    image_token_id: int = 163605
    """The placeholder (``<|media_pad|>``): one per merged image token, replaced by the tower's
    output."""
    video_token_id: int = 163840
    vision_start_token_id: int = 163602
    vision_end_token_id: int = 163604

    def __post_init__(self) -> None:
        super().__post_init__()
        problem = self.shape_problem()
        if problem is not None:
            raise problem

    def shape_problem(self) -> ConfigError | None:
        """What is wrong with the multimodal fields (named as in ``config.json``), or None."""
        if self.vision.out_dim != self.dim:
            return ConfigError(
                "text_config.hidden_size",
                self.dim,
                f"must equal the projector's output width {self.vision.out_dim} (merged image "
                "tokens replace token embeddings)",
                f"build the vision args with out_dim={self.dim}",
            )
        if not 0 <= self.image_token_id < self.vocab_size:
            return ConfigError(
                "image_token_id",
                self.image_token_id,
                f"must be a token id below vocab_size={self.vocab_size}",
                "use the tokenizer's <|media_pad|> id",
            )
        if self.mtp_depth:
            return ConfigError(
                "model.mtp_depth",
                self.mtp_depth,
                "multi-token prediction over image placeholders is not implemented for kimi_k25",
                "set --model.mtp_depth 0 (the published Kimi K2.5 has no MTP layers)",
            )
        return None

    def num_params(self, exclude_embedding: bool = False, active: bool = False) -> int:
        """The decoder's count plus the tower's and the projector's."""
        text = super().num_params(exclude_embedding=exclude_embedding, active=active)
        return text + self.vision.num_params()


DEBUG_VISION = MoonViTArgs(
    depth=2, dim=64, n_heads=4, intermediate_size=128, out_dim=256, patch_size=14,
    pos_emb_height=8, pos_emb_width=8,
)  # fmt: skip
"""A 2-block, 64-wide tower over 14-pixel patches (an 8 x 8 learned position table)."""


def _debug() -> KimiK25Args:
    text = dataclasses.replace(DEEPSEEK_V3_FLAVORS["debugmodel"], mtp_depth=0)
    fields = {f.name: getattr(text, f.name) for f in dataclasses.fields(text)}
    return KimiK25Args(**fields, vision=DEBUG_VISION, image_token_id=2047)


KIMI_K25_FLAVORS: dict[str, KimiK25Args] = {
    "debugmodel": _debug(),
    # Kimi K2.5's published shape (moonshotai/Kimi-K2.5 config.json: text_config, a Kimi K2
    # decoder; vision_config, MoonViT as transformers' Kimi_K25VisionConfig defaults):
    # 61 blocks (1 dense), MLA with 64 heads, 384 routed experts (top 8, one group) + 1 shared.
    "1T": KimiK25Args(
        dim=7168, n_layers=61, n_heads=64, vocab_size=163840, max_seq_len=262144,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, intermediate_size=18432, n_dense_layers=1, norm_eps=1e-5,
        moe=group_routed_experts(num_experts=384, top_k=8, expert_dim=2048, n_groups=1,
                                 topk_groups=1, route_scale=2.827, aux_loss_coef=0.0001),
        rope_theta=50000.0, rope_factor=64.0, rope_original_max_seq_len=4096,
        rope_beta_fast=1.0, rope_beta_slow=1.0, rope_mscale=1.0, rope_mscale_all_dim=1.0,
        vision=MoonViTArgs(out_dim=7168),
    ),
}  # fmt: skip
"""The named shapes. The trainer replaces ``vocab_size`` (tokenizer) and ``max_seq_len``
(``training.seq_len``); a Hugging Face folder's ``config.json`` sets RoPE and the norm epsilon
(``models/__init__.py: hf_folder_settings``)."""

__all__ = ["DEBUG_VISION", "KIMI_K25_FLAVORS", "KimiK25Args", "MoEArgs"]
