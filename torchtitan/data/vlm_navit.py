"""Images for a MoonViT tower (Kimi K2.5; docs/vlm.md, "Kimi K2.5", data): the rules of
transformers' ``Kimi_K25ImageProcessor``, which differ from the Qwen-VL ones of
``vlm_images.py``:

* :func:`navit_size`: never enlarged; shrunk (aspect ratio kept, sides truncated) until the
  image holds at most ``max_patches`` whole patches and at most ``max_side`` patches per side;
  then **padded** (black, at the bottom and the right) to multiples of ``patch_size *
  merge_size`` rather than resized to them;
* patches are ``3 x P x P`` (no frames per patch), in raster order (row by row), normalized with
  mean and std 0.5 (the padding becomes -1);
* an image of ``h x w`` patches stands for ``h * w / merge_size**2`` placeholders.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np
import torch

from torchtitan.data.vlm_images import BadImage


@dataclass(frozen=True)
class NavitRules:
    """``preprocessor_config.json`` of Kimi K2.5 (transformers' defaults): 14-pixel patches,
    2 x 2 merge, at most 16384 patches and 512 per side, mean and std 0.5."""

    patch_size: int = 14
    merge_size: int = 2
    max_patches: int = 16384
    max_side: int = 512
    """Patches per side at most (the processor's ``size.max_height``)."""
    max_source_pixels: int = 100_000_000
    """A decoded image larger than this (width x height, before resizing) is skipped."""
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    temporal_patch_size: int = 1

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        return 3 * self.patch_size**2

    def tokens(self, grid: tuple[int, int, int]) -> int:
        """Merged tokens (placeholders) of an image of patch grid ``(t, h, w)``."""
        t, h, w = grid
        return t * h * w // self.merge_size**2

    def encode(self, data: bytes) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """Encoded image bytes -> (patches ``[h * w, 3 * P * P]``, grid ``(1, h, w)``);
        :class:`BadImage` for what is skipped."""
        return patchify(decode(data, self), self)


def navit_size(
    height: int, width: int, patch: int, merge: int, max_patches: int, max_side: int
) -> tuple[tuple[int, int], tuple[int, int]]:
    """(the resized ``(height, width)``, the padded one) of an image of ``height x width``
    pixels: scale ``min(1, sqrt(max_patches / patches), max_side * patch / side)``, where
    ``patches`` counts whole patches (at least one per side); sides truncated, at least 1 and
    at most ``max_side * patch``; padding up to multiples of ``patch * merge``."""
    whole = max(1, height // patch) * max(1, width // patch)
    limit = max_side * patch
    scale = min(1.0, math.sqrt(max_patches / whole), limit / height, limit / width)
    h = min(max(1, int(height * scale)), limit)
    w = min(max(1, int(width * scale)), limit)
    factor = patch * merge
    return (h, w), (-(-h // factor) * factor, -(-w // factor) * factor)


def decode(data: bytes, rules: NavitRules) -> np.ndarray:
    """Encoded image bytes -> RGB ``uint8`` ``[H, W, 3]``, resized (Pillow, bicubic) and padded
    by :func:`navit_size`; raises :class:`BadImage` for what cannot be decoded or is too
    large."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:
            width, height = img.size
            if width * height > rules.max_source_pixels:
                raise BadImage(
                    f"{width}x{height} pixels > max_source_pixels={rules.max_source_pixels}"
                )
            rgb = img.convert("RGB")
            p, m = rules.patch_size, rules.merge_size
            (h, w), (ph, pw) = navit_size(height, width, p, m, rules.max_patches, rules.max_side)
            if (h, w) != (height, width):
                rgb = rgb.resize((w, h), Image.Resampling.BICUBIC)
            out = np.zeros((ph, pw, 3), dtype=np.uint8)
            out[:h, :w] = np.asarray(rgb)
            return out
    except BadImage:
        raise
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise BadImage(f"cannot decode: {type(e).__name__}: {e}") from None


def patchify(rgb: np.ndarray, rules: NavitRules) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """``[H, W, 3]`` uint8 -> (normalized patches ``[h * w, 3 * P * P]``, grid ``(1, h, w)``),
    raster order, each patch channel-major."""
    p = rules.patch_size
    x = torch.from_numpy(rgb.astype(np.float32) / 255.0).permute(2, 0, 1)  # [C, H, W]
    mean = torch.tensor(rules.mean, dtype=torch.float32)[:, None, None]
    std = torch.tensor(rules.std, dtype=torch.float32)[:, None, None]
    x = (x - mean) / std
    c, height, width = x.shape
    gh, gw = height // p, width // p
    x = x.reshape(c, gh, p, gw, p).permute(1, 3, 0, 2, 4)
    return x.reshape(gh * gw, c * p * p), (1, gh, gw)
