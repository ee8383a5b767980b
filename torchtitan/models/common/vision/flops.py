"""Training FLOPs of the vision tower (``tower.py``; docs/vlm.md, "Planning"): what MFU and the
planner add for the images of a sample, on top of the decoder's per-token count.

Per patch, with ``d`` the tower's width, ``f`` its MLP width, ``m2 = spatial_merge_size**2``
and ``L`` the patches of the patch's image (one frame; attention is confined to it), forward:

* patch embedding: ``2 * patch_dim * d`` (a linear map per patch);
* each of ``depth`` blocks: ``2 * (4 d^2 + 2 d f)`` (qkv, proj, fc1, fc2) and ``4 d L``
  (``q k^T`` and ``scores v``);
* the merger, per patch: ``2 * (m2 d^2 + d out_dim)`` (fc1 ``m2 d -> m2 d`` and fc2
  ``m2 d -> out_dim`` per merged token of ``m2`` patches).

Training is 3 x forward (the backward computes the input and the weight gradients), except the
patch embedding, whose input (the pixels) needs no gradient: 2 x. Biases, norms, GELU, the
rotary and position-table arithmetic are left out, as the decoder's count leaves them out.

Per token of a vision-language model (:func:`tower_flops_per_token`): a sample is a row of
``seq_len`` tokens, ``image_tokens`` of them merged image tokens (counted as one image); the
decoder runs every token, the tower ``image_tokens x merge^2`` patches, spread over the row.
The families count ``6 x num_params(exclude_embedding=True, active=True)`` per token, and a
vision-language family's ``num_params`` holds the tower's parameters (memory counts them),
which would charge the tower once per text token: that share is taken out and replaced by the
count per patch.
"""

from __future__ import annotations

from torchtitan.models.common.vision.args import VisionArgs

__all__ = ["tower_flops_per_token", "tower_training_flops"]


def tower_training_flops(v: VisionArgs, patches: int, patches_per_image: int = 0) -> int:
    """Forward + backward FLOPs of the tower over ``patches`` patches that come in images of
    ``patches_per_image`` patches each (0: one image of all ``patches``)."""
    length = patches_per_image or patches
    d, f, m2 = v.dim, v.intermediate_size, v.spatial_merge_size**2
    embed = 2 * 2 * v.patch_dim * d
    blocks = v.depth * (3 * 2 * (4 * d * d + 2 * d * f) + 3 * 4 * d * length)
    merger = 3 * 2 * (m2 * d * d + d * v.out_dim)
    return patches * (embed + blocks + merger)


def tower_flops_per_token(v: VisionArgs, image_tokens: int, seq_len: int) -> float:
    """What the tower changes in a vision-language family's FLOPs per token, for samples of
    ``seq_len`` tokens holding ``image_tokens`` merged image tokens (one image)."""
    patches = image_tokens * v.spatial_merge_size**2
    return tower_training_flops(v, patches) / seq_len - 6 * v.num_params()
