"""Images for vision-language training (docs/vlm.md, "Data"): decoded with Pillow, resized by
the Qwen-VL processors' rules (:func:`smart_resize`: both sides multiples of ``patch_size *
merge_size``, the area within ``[min_pixels, max_pixels]``, the aspect ratio kept), rescaled to
[0, 1], normalized, and cut into the flattened patches the vision tower reads
(``models/common/vision/tower.py``): ``[t * h * w, C * T * P * P]`` in spatial-merge-block order,
a still image repeated over the ``T`` frames of a patch. A MoonViT tower (Kimi K2.5) has its
own rules: :class:`NavitRules`."""

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

    def encode(self, data: bytes) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """Encoded image bytes -> (patches, grid) by these rules; :class:`BadImage` for what is
        skipped (another tower's rules: :class:`NavitRules`)."""
        return patchify(decode(data, self), self)


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


@dataclass(frozen=True)
class NavitRules:
    """How a MoonViT tower (Kimi K2.5) wants its images: transformers'
    ``Kimi_K25ImageProcessor`` (defaults: 14-pixel patches, 2 x 2 merge, at most 16384 patches
    and 512 per side, mean and std 0.5), which differs from the Qwen-VL rules above:

    * :func:`navit_size`: never enlarged; shrunk (aspect ratio kept, sides truncated) until the
      image holds at most ``max_patches`` whole patches and ``max_side`` patches per side; then
      **padded** (black, bottom and right) to multiples of ``patch_size * merge_size``;
    * patches are ``3 x P x P`` (no frames per patch), in raster order, normalized with mean and
      std 0.5 (the padding becomes -1); ``h * w / merge_size**2`` placeholders per image."""

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
        return raster_patchify(navit_decode(data, self), self)


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


def navit_decode(data: bytes, rules: NavitRules) -> np.ndarray:
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


def raster_patchify(
    rgb: np.ndarray, rules: NavitRules
) -> tuple[torch.Tensor, tuple[int, int, int]]:
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
