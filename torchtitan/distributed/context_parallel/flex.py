"""FlexAttention for block-causal attention under context parallel (``model.attn_backend =
"flex"``, docs/context_parallel.md).

The all-gather core knows every key by (document id, position) and every local query by the
same pair (``core.py``). :func:`document_block_mask` turns those pairs into a ``BlockMask``
once per forward of a layer, in ``O(blocks^2)`` (no ``Lq x S`` mask is materialized):

* the queries are visited in (document, position) order, so a tile of ``block`` queries holds
  few documents, whatever the load balancer's order; the keys stay in sequence order;
* a (query tile, key tile) pair is **skipped** when no query of the tile can see a key of the
  tile: their document id ranges do not overlap, or every key comes after every query in
  (document, position) order;
* it is **full** (computed without a mask) when both tiles lie in one and the same document and
  every key is at or before every query;
* otherwise it is **partial**: ``mask_mod`` decides per element, with the rule of
  ``layout.document_pairs`` (the SDPA path's) at the explicit pairs.

Skipping is conservative (a tile pair that only *may* hold a visible pair is computed, masked),
and the full tiles are exact, so the mask flex applies is the SDPA path's dense mask. Queries
and keys are padded to whole tiles with document ids no real token has (padded rows see
nothing and are dropped).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "FLEX_BLOCK",
    "compiled_flex_attention",
    "document_block_mask",
    "flex_document_attention",
]

FLEX_BLOCK = 128
"""Tile size (queries and keys) of the CP block mask: FlexAttention's default on CUDA."""

_PAD_Q, _PAD_K = -1, -2  # document ids of padding: match nothing, real ids are >= 0

_compiled: Callable[..., Any] | None = None


def compiled_flex_attention(*args: Any, **kwargs: Any) -> Any:
    """``flex_attention``, compiled once per process (eager flex materializes the scores).
    Static shapes: a second shape recompiles rather than going dynamic, whose CPU kernel
    inductor 2.13 fails to build (an undeclared ``cur_qSplitSize``); a run's shapes are fixed."""
    global _compiled
    if _compiled is None:
        from torch.nn.attention.flex_attention import flex_attention

        _compiled = torch.compile(flex_attention, dynamic=False)
    return _compiled(*args, **kwargs)


def _pad(x: torch.Tensor, length: int, value: int) -> torch.Tensor:
    """``x`` (``[B, L]``) padded with ``value`` to ``length`` along the sequence."""
    if x.shape[1] == length:
        return x
    return torch.nn.functional.pad(x, (0, length - x.shape[1]), value=value)


def _tile_stats(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Min and max of ``x`` (``[B, n * block]``) per tile: ``[B, n]`` each."""
    tiles = x.view(x.shape[0], -1, block)
    return tiles.amin(dim=2), tiles.amax(dim=2)


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """BlockMask's ordered form of bool ``[B, nq, nk]``: counts ``[B, 1, nq]`` and the key tile
    indices, those set first ``[B, 1, nq, nk]`` (int32)."""
    counts = tiles.sum(dim=2, dtype=torch.int32)
    indices = (~tiles).to(torch.int8).argsort(dim=2, stable=True).to(torch.int32)
    return counts[:, None], indices[:, None]


def document_block_mask(
    q_pos: torch.Tensor,
    q_doc: torch.Tensor,
    k_pos: torch.Tensor,
    k_doc: torch.Tensor,
    block: int = FLEX_BLOCK,
) -> Any:
    """The ``BlockMask`` of queries ``(q_pos, q_doc)`` (``[B, Lq]``, sorted by document then
    position) over keys ``(k_pos, k_doc)`` (``[B, Lk]``): query ``i`` sees key ``j`` when they
    are in one document and ``k_pos[j] <= q_pos[i]``. ``Lq`` and ``Lk`` must be whole tiles
    (:func:`flex_document_attention` pads)."""
    from torch.nn.attention.flex_attention import BlockMask

    # (document, position) as one number: a visible pair has key <= query in it too, and it
    # orders documents, so tiles spanning several documents stay tight (per-document positions)
    _, qk_hi = _tile_stats(q_doc.long() * 2**32 + q_pos, block)
    kk_lo, _ = _tile_stats(k_doc.long() * 2**32 + k_pos, block)
    q_lo, q_hi = _tile_stats(q_doc, block)
    k_lo, k_hi = _tile_stats(k_doc, block)
    qp_lo, _ = _tile_stats(q_pos, block)
    _, kp_hi = _tile_stats(k_pos, block)
    q_lo, q_hi, qp_lo, qk_hi = (t[:, :, None] for t in (q_lo, q_hi, qp_lo, qk_hi))
    k_lo, k_hi, kp_hi, kk_lo = (t[:, None, :] for t in (k_lo, k_hi, kp_hi, kk_lo))
    maybe = (q_lo <= k_hi) & (k_lo <= q_hi) & (kk_lo <= qk_hi)  # [B, nq, nk]
    one_doc = (q_lo == q_hi) & (k_lo == k_hi) & (q_lo == k_lo)
    full = one_doc & (kp_hi <= qp_lo)
    partial = maybe & ~full

    def mask_mod(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        same_doc = q_doc[b, q_idx] == k_doc[b, kv_idx]
        return same_doc & (k_pos[b, kv_idx] <= q_pos[b, q_idx])

    return BlockMask.from_kv_blocks(
        *_ordered(partial),
        *_ordered(full),
        BLOCK_SIZE=block,
        mask_mod=mask_mod,
        seq_lengths=(q_doc.shape[1], k_doc.shape[1]),
    )


def flex_document_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    where: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    block: int = FLEX_BLOCK,
    kernel: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """Block-causal attention of queries ``q`` (``[B, H, Lq, Dh]``, any order) over keys
    ``k, v`` (``[B, Hkv, Lk, Dh]``, ``H`` a multiple of ``Hkv``: grouped-query heads are not
    repeated), ``where = (q_pos, q_doc, k_pos, k_doc)``: FlexAttention over
    :func:`document_block_mask`, the queries sorted by (document, position) for it and the
    output returned in their order. ``kernel`` (default :func:`compiled_flex_attention`) takes
    ``flex_attention``'s arguments (tests pass a dense one: torch 2.13's CPU flex has no
    backward)."""
    q_pos, q_doc, k_pos, k_doc = where
    lq, lk = q.shape[2], k.shape[2]
    order = (q_doc.long() * 2**32 + q_pos).argsort(dim=1)  # positions < 2**32
    q_s = q.gather(2, order[:, None, :, None].expand_as(q))
    pad_q, pad_k = -lq % block, -lk % block
    q_s = torch.nn.functional.pad(q_s, (0, 0, 0, pad_q))
    k, v = (torch.nn.functional.pad(t, (0, 0, 0, pad_k)) for t in (k, v))
    mask = document_block_mask(
        _pad(q_pos.gather(1, order), lq + pad_q, 0),
        _pad(q_doc.gather(1, order), lq + pad_q, _PAD_Q),
        _pad(k_pos, lk + pad_k, 0),
        _pad(k_doc, lk + pad_k, _PAD_K),
        block,
    )
    kernel = compiled_flex_attention if kernel is None else kernel
    out = kernel(q_s, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1])[:, :, :lq]
    inverse = order.argsort(dim=1)
    return out.gather(2, inverse[:, None, :, None].expand(*out.shape[:3], out.shape[3]))
