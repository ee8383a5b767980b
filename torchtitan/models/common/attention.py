"""Attention masks and kernels shared by model families (docs/attention.md).

One mask definition, :func:`document_causal_mask_mod`, a FlexAttention ``mask_mod`` of
``(b, h, q_idx, kv_idx)``: a query attends to a key at or before it in the same document. It
feeds every kernel:

* ``flex`` (CUDA): :func:`build_attention_mask` turns it into a ``BlockMask`` once per batch
  (``create_block_mask``), shared by every layer; blocks between documents are skipped.
* ``sdpa`` (any device, the exact CPU path with backward): :func:`dense_mask` evaluates the same
  function on broadcast index tensors, giving a boolean ``[B, 1, Lq, Lk]`` mask for SDPA.
* context parallel's all-gather core evaluates it at global query positions over the gathered
  document ids (``AttentionMask.dense``), so it masks by position and document; with ``flex``
  it builds its own ``BlockMask`` of the local queries over the gathered keys per forward
  (``distributed/context_parallel/flex.py``), and the model's mask carries only the ids.

Document ids count the documents of a packed window: ``doc_ids[b, i]`` is the number of EOS
tokens among ``inputs[b, :i]`` (the data loader makes them, ``data/dataloader.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.distributed.context_parallel.flex import compiled_flex_attention
from torchtitan.distributed.context_parallel.layout import positions_in_documents

__all__ = [
    "AttentionCore",
    "AttentionMask",
    "allowed_keys",
    "MaskMod",
    "OptMask",
    "build_attention_mask",
    "dense_mask",
    "document_causal_mask_mod",
    "document_positions",
    "resolve_attn_backend",
]

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def document_causal_mask_mod(doc_ids: torch.Tensor) -> MaskMod:
    """The block-causal ("document") mask over ``doc_ids`` (int ``[B, S]``): ``True`` where
    query ``q_idx`` of sample ``b`` may attend to key ``kv_idx``."""

    def mask_mod(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        return (kv_idx <= q_idx) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])

    return mask_mod


def dense_mask(
    mask_mod: MaskMod, batch: int, q_idx: torch.Tensor, kv_idx: torch.Tensor
) -> torch.Tensor:
    """``mask_mod`` evaluated at every (sample, query, key): bool ``[batch, 1, Lq, Lk]``."""
    b = torch.arange(batch, device=q_idx.device)[:, None, None, None]
    h = torch.zeros((), dtype=torch.int64, device=q_idx.device)
    return mask_mod(b, h, q_idx[None, None, :, None], kv_idx[None, None, None, :])


def allowed_keys(
    q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None, doc_ids: torch.Tensor | None
) -> torch.Tensor:
    """Bool ``[B or 1, 1, Lq, Lk]``: key ``k_pos[j]`` visible to query ``q_pos[i]`` (causal,
    within ``window`` when set: ``0 <= i - j < window``, same document when ``doc_ids``
    (``[B, S]``) are given). The sliding-window mask of GPT-OSS and Qwen3."""
    dist = q_pos[:, None] - k_pos[None, :]
    keep = dist >= 0
    if window is not None:
        keep = keep & (dist < window)
    keep = keep[None, None]
    if doc_ids is not None:
        same = doc_ids[:, q_pos][:, :, None] == doc_ids[:, k_pos][:, None, :]
        keep = keep & same[:, None]
    return keep


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """Position of every token within its document (int64 ``[B, S]``): RoPE positions that
    restart at 0 where a document starts (the same count context parallel balances)."""
    return positions_in_documents(doc_ids)


class AttentionMask(NamedTuple):
    """What one forward's attention layers share: the document ids of the tokens the model
    holds and, for the flex backend, the ``BlockMask`` built from them once per batch."""

    doc_ids: torch.Tensor
    block_mask: Any = None  # torch.nn.attention.flex_attention.BlockMask
    positions: torch.Tensor | None = None
    """The RoPE positions of these tokens (``[S]`` or ``[B, S]``), when the forward got them:
    context parallel's core masks by them (in a document they order tokens as the sequence
    does), since under its load balancers a rank's tokens are not a contiguous stretch."""

    def dense(
        self,
        q_idx: torch.Tensor | None = None,
        kv_idx: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The boolean SDPA mask ``[B, 1, Lq, Lk]`` at positions ``q_idx`` x ``kv_idx``
        (default: every position of ``doc_ids``, itself defaulting to this mask's)."""
        ids = self.doc_ids if doc_ids is None else doc_ids
        full = torch.arange(ids.shape[1], device=ids.device)
        return dense_mask(
            document_causal_mask_mod(ids),
            ids.shape[0],
            full if q_idx is None else q_idx,
            full if kv_idx is None else kv_idx,
        )


OptMask = AttentionMask | None
"""A layer's ``mask`` argument: ``None`` is plain causal attention."""


def build_attention_mask(
    doc_ids: torch.Tensor, backend: str, positions: torch.Tensor | None = None
) -> AttentionMask:
    """The mask every layer of one forward uses; ``flex`` builds its ``BlockMask`` here, once.
    ``positions`` (the forward's RoPE positions) ride along for context parallel's core."""
    if backend != "flex":
        return AttentionMask(doc_ids, positions=positions)
    from torch.nn.attention.flex_attention import create_block_mask

    batch, seq = doc_ids.shape
    block = create_block_mask(
        document_causal_mask_mod(doc_ids), batch, None, seq, seq, device=doc_ids.device
    )
    return AttentionMask(doc_ids, block, positions)


def resolve_attn_backend(backend: str, device_type: str, cp_enabled: bool) -> str:
    """``auto`` -> ``flex`` on CUDA without context parallel, else ``sdpa`` (CPU training has
    no flex backward; under context parallel flex is opt-in: ``flex`` itself, which the
    all-gather core runs over the gathered keys, not yet run on a GPU here)."""
    if backend != "auto":
        return backend
    return "flex" if device_type == "cuda" and not cp_enabled else "sdpa"


def _flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any) -> Any:
    """FlexAttention, compiled once per process (eager flex materializes the scores); the one
    compiled instance context parallel's core uses too."""
    return compiled_flex_attention(q, k, v, block_mask=block_mask)


class AttentionCore(nn.Module):
    """``q, k, v`` (``[B, H, S, Dh]``, K/V heads already repeated) -> attention output.

    Causal SDPA without a mask; with an :class:`AttentionMask`, FlexAttention over its
    ``BlockMask`` when it has one, else SDPA with the same mask made dense (exact, with
    backward on every device). With ``window`` (Qwen3's sliding window) SDPA with the dense
    :func:`allowed_keys` mask (window and documents), on every backend. A module of its own so
    context parallel can replace it (families with a window offer no CP).
    """

    def __init__(self, window: int | None = None) -> None:
        super().__init__()
        self.window = window

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: OptMask = None
    ) -> torch.Tensor:
        if self.window is not None:
            pos = torch.arange(q.shape[2], device=q.device)
            keep = allowed_keys(pos, pos, self.window, None if mask is None else mask.doc_ids)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if mask.block_mask is not None:
            return _flex_attention(q, k, v, mask.block_mask)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense())
