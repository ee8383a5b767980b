"""A shared vision tower for vision-language families (docs/vlm.md): its shape
(``args.py``), the modules (``tower.py``), and the position bookkeeping of patches and of the
decoder's multimodal RoPE (``positions.py``)."""

from torchtitan.models.common.vision.args import VisionArgs
from torchtitan.models.common.vision.positions import (
    mrope_freqs,
    mrope_positions,
    scatter_visual,
)
from torchtitan.models.common.vision.tower import VisionTower

__all__ = ["VisionArgs", "VisionTower", "mrope_freqs", "mrope_positions", "scatter_visual"]
