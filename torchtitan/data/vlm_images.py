"""Images for vision-language training (docs/vlm.md, "Data"): decoded with Pillow, resized by
the Qwen-VL processors' rules (:func:`smart_resize`: both sides multiples of ``patch_size *
merge_size``, the area within ``[min_pixels, max_pixels]``, the aspect ratio kept), rescaled to
[0, 1], normalized, and cut into the flattened patches the vision tower reads
(``models/common/vision/tower.py``): ``[t * h * w, C * T * P * P]`` in spatial-merge-block order,
a still image repeated over the ``T`` frames of a patch."""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np
import torch

MAX_ASPECT = 200
"""The processors refuse images whose long side is more than this many times the short one."""


class BadImage(ValueError):
    """An image that is skipped (corrupt, too large to decode, too narrow): counted, never
    raised past the dataset."""


@dataclass(frozen=True)
class ImageRules:
    """How images become patches (the processor's ``preprocessor_config.json`` values for
    Qwen3.5: 16-pixel patches, 2 x 2 merge, 2 frames, mean and std 0.5)."""

    patch_size: int = 16
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 64 * 32 * 32
    max_pixels: int = 16384 * 32 * 32
    max_source_pixels: int = 100_000_000
    """A decoded image larger than this (width x height, before resizing) is skipped."""
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """Values per flattened patch (3 channels x frames x pixels)."""
        return 3 * self.temporal_patch_size * self.patch_size**2

    def tokens(self, grid: tuple[int, int, int]) -> int:
        """Merged tokens (placeholders) of an image of patch grid ``(t, h, w)``."""
        t, h, w = grid
        return t * h * w // self.merge_size**2


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """The size an image of ``height x width`` is resized to: each side rounded to a multiple of
    ``factor``; if the area is then above ``max_pixels`` (below ``min_pixels``) both sides are
    scaled down (up) by the same ratio and floored (ceiled) to multiples of ``factor``."""
    if max(height, width) > MAX_ASPECT * min(height, width):
        raise BadImage(f"aspect ratio {max(height, width) / min(height, width):.0f} > {MAX_ASPECT}")
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def decode(data: bytes, rules: ImageRules) -> np.ndarray:
    """Encoded image bytes -> RGB ``uint8`` ``[H, W, 3]`` at the processor's size; raises
    :class:`BadImage` for what cannot be decoded or is too large."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:
            width, height = img.size
            if width * height > rules.max_source_pixels:
                raise BadImage(
                    f"{width}x{height} pixels > max_source_pixels={rules.max_source_pixels}"
                )
            rgb = img.convert("RGB")
            h, w = smart_resize(height, width, rules.factor, rules.min_pixels, rules.max_pixels)
            if (h, w) != (height, width):
                rgb = rgb.resize((w, h), Image.Resampling.BICUBIC)
            return np.asarray(rgb)
    except BadImage:
        raise
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise BadImage(f"cannot decode: {type(e).__name__}: {e}") from None


def patchify(rgb: np.ndarray, rules: ImageRules) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """``[H, W, 3]`` uint8 -> (normalized patches ``[h * w, 3 * T * P * P]``, grid
    ``(1, h, w)``), patches ordered by merge block (``m x m`` neighbours together)."""
    p, m, t = rules.patch_size, rules.merge_size, rules.temporal_patch_size
    x = torch.from_numpy(rgb.astype(np.float32) / 255.0).permute(2, 0, 1)  # [C, H, W]
    mean = torch.tensor(rules.mean, dtype=torch.float32)[:, None, None]
    std = torch.tensor(rules.std, dtype=torch.float32)[:, None, None]
    x = (x - mean) / std
    c, height, width = x.shape
    gh, gw = height // p, width // p
    x = x.reshape(c, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
    x = x[:, :, :, :, :, None].expand(*x.shape[:5], t, p, p)  # the frame repeated
    return x.reshape(gh * gw, c * t * p * p), (1, gh, gw)
