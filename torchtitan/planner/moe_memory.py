"""Mixture-of-Experts terms of the memory estimate and the planner (docs/planning.md, "MoE").

One home for every MoE quantity the estimator, the planner and ``--job.explain`` use: what a
rank stores and gathers of an MoE block (router, routed experts, shared experts), what the
block saves for backward, and the all-to-all volume of expert parallel.

Layout (docs/parallelisms.md, "Expert parallel"): ``dp_shard = efsdp x ep``. Each ``ep`` rank
holds ``E / ep`` of every MoE layer's routed experts (stacked ``[E, dim, expert_dim]``
weights, split on dimension 0); with ``efsdp > 1`` FSDP shards them further (dimension 0, padded
to a multiple of ``efsdp``) and gathers ``E / ep`` experts while the layer runs; with
``efsdp = 1`` they are kept whole and never gathered. Without expert parallel the experts are
part of the block's FSDP unit like any other weight. The router and the shared experts are
ordinary block weights (FSDP over ``dp_shard x cp``; replicated over TP, where the MoE block
runs whole on every TP rank).

Saved activations of an MoE feed-forward over ``T`` tokens (top-``k``, ``E`` experts, width
``d``, expert width ``e``, shared width ``s``), counted from what autograd saves in
``models/common/moe.py`` (``tests/unit/test_moe_estimator.py`` checks it with
``saved_tensors_hooks``): ``3 T k`` rows of width ``d`` (the permuted inputs, the expert
outputs, the weighted outputs), ``4 T k`` values of width ``e`` (the expert SwiGLU), ``4 T s``
for the shared experts, the fp32 scores ``[T, E]`` and routing weights, and the int64 indices
(``T k`` expert ids, two ``T k`` permutations). Under expert parallel the rows are the ones a
rank receives, ``T k`` on average (uniform routing).

Under expert parallel one more ``[T k, d]`` buffer per MoE layer stays alive from the forward
to the backward (measured with ``LiveTensorTracker``; not a tensor autograd saves: the
all-to-all's).

Qwen3's QK-norm adds, per token, the pre- and post-norm queries and keys (``2 (H + H_kv) hd``
values) and their fp32 RMS statistics; it is counted here for any model whose args say
``qk_norm``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = [
    "BlockSizes",
    "ExpertLayout",
    "all_to_all_bytes",
    "block_sizes",
    "expert_layout",
    "layer_expert_elems",
    "moe_activation_delta",
    "moe_backward_delta",
    "moe_layers_per_rank",
    "moe_of",
    "qk_norm_activation_bytes",
]


def moe_of(a: Any, layer: int | None = None) -> Any:
    """The ``MoEArgs`` of ``a`` (of block ``layer`` when given), or None for a dense block."""
    moe = getattr(a, "moe", None)
    if moe is None or (layer is not None and not a.is_moe_layer(layer)):
        return None
    return moe


def moe_layers_per_rank(a: Any, blocks_of_ranks: list[list[int]]) -> int:
    """MoE layers on the rank that holds the most (``blocks_of_ranks``: each pipeline rank's
    block ids; one list without pipeline parallel)."""
    return max(sum(a.is_moe_layer(i) for i in blocks) for blocks in blocks_of_ranks)


@dataclass(frozen=True)
class ExpertLayout:
    """How one MoE layer's routed experts sit on a rank."""

    ep: int
    efsdp: int
    """FSDP shards of the experts beside ``ep`` (``dp_shard x cp / ep`` without EP: the block's)."""
    local_experts: int
    """Experts per layer on this ``ep`` rank (``E / ep``)."""
    stored_experts: int
    """Rows of dimension 0 this rank stores: ``ceil(E / ep / efsdp)`` (FSDP pads)."""
    gathered_experts: int
    """Experts gathered in the compute dtype while the layer runs (0: kept whole, not FSDP)."""


def expert_layout(moe: Any, ep: int, n_shard: int, fsdp: bool) -> ExpertLayout:
    """``n_shard``: the ranks the blocks' FSDP shards over (``dp_shard x cp``)."""
    local = moe.num_experts // ep
    if ep > 1:
        efsdp = n_shard // ep
        return ExpertLayout(ep, efsdp, local, math.ceil(local / efsdp), local if efsdp > 1 else 0)
    n = n_shard if fsdp else 1
    return ExpertLayout(1, n, local, math.ceil(local / n), local if fsdp else 0)


def expert_elems(a: Any) -> int:
    """Elements of one routed expert: three ``dim x expert_dim`` matrices."""
    return 3 * a.dim * a.moe.expert_dim


@dataclass(frozen=True)
class BlockSizes:
    """Elements of one block on one rank."""

    stored: int
    """The rank's parameter shard, as stored."""
    gathered: int
    """Gathered (or cast) in the compute dtype while the block runs, and the size of its
    unsharded gradients before the reduce-scatter."""
    linear_gathered: int
    """Of ``gathered``, matmul weights (float8 all-gather)."""
    experts_stored: int = 0
    """Of ``stored``, the routed experts."""
    experts_gathered: int = 0
    """Of ``gathered``, the routed experts."""


def block_sizes(
    a: Any,
    dense_block: tuple[tuple[int, int], ...],
    dense_linear: tuple[bool, ...],
    layer: int,
    stored: Any,
    ep: int,
    n_shard: int,
    fsdp: bool,
) -> BlockSizes:
    """Sizes of block ``layer``; ``dense_block`` are the estimator's dense-block shapes after
    TP (the attention's, three SwiGLU matrices, two norms) and ``stored(shapes)``
    its per-rank storage of a list of 2-D shapes."""
    shapes = list(dense_block)
    linear = list(dense_linear)
    extra: list[tuple[int, int]] = []
    if getattr(a, "qk_norm", False):
        extra = [(a.head_dim, 1), (a.head_dim, 1)]
    moe = moe_of(a, layer)
    if moe is None:
        full = shapes + extra
        lin = sum(x * y for (x, y), is_lin in zip(shapes, linear) if is_lin)
        return BlockSizes(stored(full), sum(x * y for x, y in full), lin)
    # The attention (wq wk wv wo, or MLA's); the SwiGLU matrices are replaced by the MoE layer.
    attention = shapes[:-5]
    d, s = a.dim, moe.num_shared_experts * moe.expert_dim
    ffn = [(moe.num_experts, d)] + ([(s, d), (d, s), (s, d)] if s else [])
    dense_part = attention + ffn + shapes[-2:] + extra
    experts_stored, experts_gathered = layer_expert_elems(a, ep, n_shard, fsdp)
    dense_gathered = sum(x * y for x, y in dense_part)
    attention_linear = sum(x * y for (x, y), lin in zip(attention, linear) if lin)
    return BlockSizes(
        stored=stored(dense_part) + experts_stored,
        gathered=dense_gathered + experts_gathered,
        linear_gathered=attention_linear + sum(x * y for x, y in ffn) + experts_gathered,
        experts_stored=experts_stored,
        experts_gathered=experts_gathered,
    )


def layer_expert_elems(a: Any, ep: int, n_shard: int, fsdp: bool) -> tuple[int, int]:
    """(stored, gathered) routed-expert elements of one MoE layer on one rank: the estimator's
    block sizes and explain's expert memory both come from here."""
    lay = expert_layout(a.moe, ep, n_shard, fsdp)
    return lay.stored_experts * expert_elems(a), lay.gathered_experts * expert_elems(a)


# ---------------------------------------------------------------------- activations
def qk_norm_activation_bytes(a: Any, tokens: int, act: int, tp: int, mode: str) -> int:
    """QK-norm's saved tensors (mode 'none'; recomputed under full and op-level AC)."""
    if not getattr(a, "qk_norm", False) or mode != "none":
        return 0
    heads = (a.n_heads + a.kv_heads) / tp
    return int(tokens * heads * (2 * a.head_dim * act + 4))


def moe_activation_delta(
    a: Any, layer: int, tokens: int, act: int, tp: int, mode: str, ep: int = 1
) -> int:
    """Saved bytes of block ``layer``'s MoE feed-forward minus the dense SwiGLU the dense
    formula counts (``4 h / tp`` values per token, ``h / tp`` under op-level AC); 0 for a dense
    block. The MoE layer runs on the whole sequence of every TP rank."""
    moe = moe_of(a, layer)
    if moe is None or mode == "full":
        return 0
    hid = a.hidden_dim / tp
    d, k, e, n = a.dim, moe.top_k, moe.expert_dim, moe.num_experts
    s = moe.num_shared_experts * moe.expert_dim
    if mode == "op":
        # Saved: the router's matmul output (the first MoE matmul the policy sees) and the
        # shared experts' w3 output; the grouped GEMMs and the all-to-alls are recomputed.
        saved = tokens * (n * act + s * act)
        return int(saved - tokens * (hid + d) * act)
    rows = tokens * k
    routed = rows * (3 * d + 4 * e) * act
    shared = tokens * 4 * s * act
    routing = tokens * (n + 2 * k + 1) * 4 + rows * 3 * 8
    # Under expert parallel one more [T k, d] buffer per layer stays alive with the graph
    # (measured: +1.0 MiB per layer at 1024 rows x 256 x fp32; an all-to-all buffer).
    exchange = rows * d * act if ep > 1 else 0
    return int(routed + shared + routing + exchange - tokens * 4 * hid * act)


def moe_backward_delta(
    a: Any, layer: int, tokens: int, act: int, tp: int, expert_grad_bytes: int
) -> int:
    """The MoE block's backward working set minus what the dense formula counts for it (two
    SwiGLU-wide gradients, and ``expert_grad_bytes``: the routed experts' share of the block's
    own gradients, which the estimator adds with the rest of the block's).

    The MoE backward makes the gradients of the ``T k`` rows (two of width ``d``, two of the
    expert width ``e``), of the shared experts and of the expert weights while it frees the
    routed rows it saved (``T k (3 d + 4 e)`` values); only what exceeds them adds to the
    peak. Measured: without this the debug flavor's block backward was 6-8% high."""
    moe = moe_of(a, layer)
    if moe is None:
        return 0
    rows = tokens * moe.top_k
    s = moe.num_shared_experts * moe.expert_dim
    d, e = a.dim, moe.expert_dim
    made = rows * (2 * d + 2 * e) * act + expert_grad_bytes
    freed = rows * (3 * d + 4 * e) * act
    dense = tokens * 2 * a.hidden_dim / tp * act
    return int(max(0, made - freed) + tokens * 2 * s * act - dense - expert_grad_bytes)


# ---------------------------------------------------------------------- all-to-all
def all_to_all_bytes(a: Any, tokens: int, act: int, ep: int) -> float:
    """Bytes one rank sends in one all-to-all of one MoE layer (a dispatch or a combine, one
    direction) over ``tokens`` local tokens: ``(ep - 1) / ep`` of its ``tokens x top_k`` routed
    rows of width ``dim`` leave it under uniform routing. A micro-step moves four of these per
    MoE layer: dispatch and combine, forward and backward."""
    moe = moe_of(a)
    if moe is None or ep <= 1:
        return 0.0
    return tokens * moe.top_k * a.dim * act * (ep - 1) / ep
