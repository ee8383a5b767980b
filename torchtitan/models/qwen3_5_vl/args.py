"""Qwen3.5 with vision (``Qwen3_5ForConditionalGeneration``; docs/vlm.md): the Qwen3.5 text
decoder's args (``models/qwen3_5/args.py``) plus the vision tower's shape, the image
placeholder token and the MRoPE split of the rotated frequencies."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

from torchtitan.config.errors import ConfigError
from torchtitan.models.common.vision import VisionArgs
from torchtitan.models.qwen3_5.args import QWEN35_FLAVORS, Qwen35Args


@dataclass
class Qwen35VLArgs(Qwen35Args):
    """A Qwen3.5 decoder (dense or MoE) fed by a vision tower."""

    vision: VisionArgs = field(default_factory=VisionArgs)
    image_token_id: int = 248056
    """The placeholder token: one per merged image token, replaced by the tower's output."""
    video_token_id: int = 248057
    vision_start_token_id: int = 248053
    vision_end_token_id: int = 248054
    mrope_section: tuple[int, int, int] = (11, 11, 10)
    """How many of the rotated frequencies follow time, height and width (interleaved:
    ``positions.py: mrope_axes``)."""

    HF_FOLDER_TYPES: ClassVar[tuple[str, ...]] = ("qwen3_5", "qwen3_5_moe")
    """The ``config.json`` model types a run of this family starts from (its multimodal
    checkpoints; ``models.hf_folder_settings`` reads them; ``family_for_hf_config`` still gives
    them to the text family ``qwen3_5``)."""
    HF_FOLDER_FIELDS: ClassVar[tuple[str, ...]] = (
        "image_token_id",
        "video_token_id",
        "vision_start_token_id",
        "vision_end_token_id",
        "mrope_section",
    )
    """What such a run takes from the folder's ``config.json`` beyond the generic settings:
    the token ids the data and the model share, and the MRoPE split (RoPE, as ``rope_theta``)."""

    def shape_problem(self) -> ConfigError | None:
        problem = super().shape_problem()
        if problem is not None:
            return problem
        if self.vision.out_dim != self.dim:
            return ConfigError(
                "vision_config.out_hidden_size",
                self.vision.out_dim,
                f"must equal the decoder's hidden_size={self.dim} (merged image tokens replace "
                "token embeddings)",
                f"set out_hidden_size to {self.dim}",
            )
        if not 0 <= self.image_token_id < self.vocab_size:
            return ConfigError(
                "image_token_id",
                self.image_token_id,
                f"must be a token id below vocab_size={self.vocab_size}",
                "use the tokenizer's <|image_pad|> id",
            )
        return None

    def num_params(self, exclude_embedding: bool = False, active: bool = False) -> int:
        """The decoder's count plus the vision tower's."""
        text = super().num_params(exclude_embedding=exclude_embedding, active=active)
        return text + self.vision.num_params()


DEBUG_VISION = VisionArgs(
    depth=2,
    dim=64,
    n_heads=4,
    intermediate_size=128,
    out_dim=256,
    patch_size=16,
    temporal_patch_size=2,
    spatial_merge_size=2,
    num_position_embeddings=64,
)
"""A 2-block, 64-wide tower over 16-pixel patches (an 8 x 8 learned position table)."""


def _vl(text: Qwen35Args, **extra: object) -> Qwen35VLArgs:
    fields = {f.name: getattr(text, f.name) for f in dataclasses.fields(text)}
    return Qwen35VLArgs(**fields, **extra)  # type: ignore[arg-type]


QWEN35_VL_FLAVORS: dict[str, Qwen35VLArgs] = {
    "debugmodel": _vl(QWEN35_FLAVORS["debugmodel"], vision=DEBUG_VISION, image_token_id=2047),
    "debugmodel_moe": _vl(
        QWEN35_FLAVORS["debugmodel_moe"], vision=DEBUG_VISION, image_token_id=2047
    ),
    # Qwen3.5-397B-A17B: its text decoder and its 27-block tower (VisionArgs' defaults, which
    # are the published tower's) projecting to the decoder's width
    "397B-A17B": _vl(
        QWEN35_FLAVORS["397B-A17B"], vision=VisionArgs(out_dim=4096), image_token_id=248056
    ),
}
"""The named shapes; other published models come from their ``config.json`` (``hf.py``)."""

__all__ = ["DEBUG_VISION", "QWEN35_VL_FLAVORS", "Qwen35VLArgs"]
