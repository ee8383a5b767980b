"""Memory of the vision tower (``tower.py``; docs/planning.md, "Vision-language models"): its
parameters as FSDP shards them and what autograd saves while it encodes images. The
estimator (``planner/memory_terms.py: tower_memory``, ``planner/rank_memory.py``) places them.

Where the tower lives (``models/qwen3_5_vl/parallel_plan.py``): whole on the first pipeline
stage (with the token embedding), replicated across tensor parallel (not divided by ``tp``),
and run by every context-parallel rank on the whole batch's images (its activations are not
divided by ``cp``). FSDP shards it as its own units (each block, then the rest), gathered
only while it runs. Activation checkpointing wraps the tower's blocks as it wraps the
decoder's (the plan's ``extra_blocks``): a block it wraps whole saves only its input, ``d``
per patch, and its backward recomputes the rest (one block's saved activations live then).
Op-level selective AC is counted as no AC (an upper bound).

Saved per patch (``tower.py``, counted with ``saved_tensors_hooks`` on the debug tower,
``tests/unit/test_vlm_planner.py``), ``d`` the width, ``f`` the MLP width, ``H`` heads of
width ``Dh``, ``L`` the patches of the patch's image:

* the patch embedding's input (``patch_dim``, in the compute dtype);
* per block, ``10 d + 2 f`` in the compute dtype (block input, both LayerNorms' inputs and
  outputs, qkv, the rotated q and k, the attention output and its concatenation, the MLP's
  hidden state before and after GELU), ``4 + 2 Dh`` fp32 values (the LayerNorm statistics, the
  RoPE cosines and sines of q and k), and the attention's softmax statistics: ``H`` fp32
  log-sum-exp values on CUDA, the ``H x L`` probabilities on CPU (torch's math path here);
* the merger: ``4 d`` (its LayerNorm's input and output, fc1's output, GELU's output) and its
  two fp32 statistics.
"""

from __future__ import annotations

from torchtitan.models.common.vision.args import VisionArgs

__all__ = [
    "tower_backward_bytes",
    "tower_block_saved_bytes",
    "tower_saved_bytes",
    "tower_shapes",
]

Shape = tuple[int, int]


def tower_shapes(v: VisionArgs) -> tuple[list[Shape], list[list[Shape]]]:
    """The tower's parameters as FSDP shards them (dim 0 first): the root unit's (patch
    embedding, position table, merger) and each block's."""
    d, f, m = v.dim, v.intermediate_size, v.dim * v.spatial_merge_size**2
    root = [(d, v.patch_dim), (d, 1), (v.num_position_embeddings, d)]
    root += [(d, 1), (d, 1), (m, m), (m, 1), (v.out_dim, m), (v.out_dim, 1)]
    block = [(d, 1), (d, 1), (3 * d, d), (3 * d, 1), (d, d), (d, 1)]  # norm1, qkv, proj
    block += [(d, 1), (d, 1), (f, d), (f, 1), (d, f), (d, 1)]  # norm2, fc1, fc2
    return root, [list(block) for _ in range(v.depth)]


def tower_block_saved_bytes(v: VisionArgs, per_image: int, act: int, device_type: str) -> int:
    """Bytes one tower block saves per patch without activation checkpointing."""
    d, f = v.dim, v.intermediate_size
    attention = v.n_heads * per_image * act if device_type == "cpu" else v.n_heads * 4
    return (10 * d + 2 * f) * act + (4 + 2 * v.head_dim) * 4 + attention


def tower_saved_bytes(
    v: VisionArgs, patches: int, per_image: int, act: int, device_type: str, checkpointed: int = 0
) -> int:
    """Bytes autograd saves while the tower encodes ``patches`` patches in images of
    ``per_image`` patches each, ``checkpointed`` of its blocks wrapped whole by activation
    checkpointing (module docstring)."""
    block = tower_block_saved_bytes(v, per_image, act, device_type)
    merger = 4 * v.dim * act + 2 * 4
    kept = (v.depth - checkpointed) * block + checkpointed * v.dim * act
    return patches * (v.patch_dim * act + kept + merger)


def tower_backward_bytes(v: VisionArgs, patches: int, per_image: int, act: int, cpu: bool) -> int:
    """The working set of one tower block's backward: the incoming gradient and its input's,
    two MLP-wide gradients, and (CPU's math path) one image's attention-probability gradient."""
    probs = v.n_heads * per_image * per_image * act if cpu else 0
    return patches * (2 * v.dim + 2 * v.intermediate_size) * act + probs
