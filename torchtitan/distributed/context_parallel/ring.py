"""Ring attention with the block-causal (document) mask, for ``context_parallel_method = "ring"``
with ``model.attn_mask_type = "block_causal"`` (docs/context_parallel.md, "Packed documents
(block_causal) under context parallel").

torch's experimental ring attention has no document mask, so block-causal runs on this one
(any device). Each rank keeps its queries; its K/V shard, with the document ids and positions of
those keys, travels ``cp - 1`` times to the next rank of the ring (point to point). At every step
a rank attends its queries to the keys it holds, masked by document and position, and keeps the
partial output with its log-sum-exp; the partials are merged at the end (the softmax of the
whole row, exactly, up to floating-point order). A step whose keys all belong to other
documents or lie after every query is skipped (the K/V still moves on). The backward sends the
K/V gradients back along the ring to their owners. Each step's shard is kept for the backward,
so memory is the all-gather core's; the communication is ``cp - 1`` point-to-point exchanges.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.checkpoint import checkpoint

from torchtitan.distributed.context_parallel.layout import DocumentMask, document_pairs, shard_index

__all__ = ["RingDocumentAttention"]

_MASKED = -1e30  # finite: a row with no key in a step gets weight exp(-1e30 - lse) = 0, no NaN


def _shift(x: torch.Tensor, group: Any, to: int, frm: int) -> torch.Tensor:
    """Send ``x`` to global rank ``to``, receive the same shape from ``frm``."""
    out = torch.empty_like(x)
    ops = [dist.P2POp(dist.isend, x, to, group), dist.P2POp(dist.irecv, out, frm, group)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return out


class _RingShift(torch.autograd.Function):
    """Autograd pass to the next rank; the gradient goes back to the previous one."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, nxt: int, prv: int) -> torch.Tensor:
        ctx.group, ctx.nxt, ctx.prv = group, nxt, prv
        return _shift(x.contiguous(), group, nxt, prv)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _shift(grad.contiguous(), ctx.group, ctx.prv, ctx.nxt), None, None, None


def _partial(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    q_doc: torch.Tensor,
    k_pos: torch.Tensor,
    k_doc: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` over one K/V shard: (output normalised within the shard, its
    log-sum-exp ``[B, H, Lq]``; about -1e30 for rows with no allowed key)."""
    allowed = document_pairs(q_pos, q_doc, k_pos, k_doc)[:, None]
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~allowed, _MASKED)
    lse = scores.logsumexp(dim=-1)
    return (scores - lse[..., None]).exp() @ v, lse


class RingDocumentAttention(nn.Module):
    """Block-causal attention over the whole sequence for this rank's queries, by ring.

    ``q, k, v``: ``[B, H, L, Dh]`` (K/V heads repeated ``n_rep`` times by the model: only the
    distinct ones travel). ``mask``: this rank's document ids and RoPE positions (tokens are in
    any order: either load balancer)."""

    compile_graph_breaks = True  # point-to-point sends and per-step skips run eagerly

    def __init__(self, cp_mesh: DeviceMesh, n_rep: int) -> None:
        super().__init__()
        self.cp, self.rank, self.n_rep = cp_mesh.size(), cp_mesh.get_local_rank(), n_rep
        self.group = cp_mesh.get_group()
        ranks = [dist.get_global_rank(self.group, r) for r in range(self.cp)]
        self.nxt, self.prv = ranks[(self.rank + 1) % self.cp], ranks[(self.rank - 1) % self.cp]
        self.steps_skipped = 0  # ring steps with no allowed (query, key) pair, since built

    def extra_repr(self) -> str:
        return f"cp={self.cp}, rank={self.rank}, n_rep={self.n_rep}"

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: DocumentMask | None = None
    ) -> torch.Tensor:
        assert mask is not None, "the ring core runs block_causal only (torch's ring: causal)"
        batch, local = q.shape[0], q.shape[2]
        pos = mask.positions
        if pos is None:
            pos = shard_index(local * self.cp, self.cp, self.rank, "headtail").to(q.device)
        q_pos = pos.to(q.device).expand(batch, local).contiguous()
        q_doc = mask.doc_ids.contiguous()
        kv = torch.stack((k[:, :: self.n_rep], v[:, :: self.n_rep]))
        keys = torch.stack((q_pos, q_doc.to(q_pos.dtype)))
        outs, lses = [], []
        for step in range(self.cp):
            if step > 0:
                kv = _RingShift.apply(kv, self.group, self.nxt, self.prv)
                keys = _shift(keys, self.group, self.nxt, self.prv)
            if not document_pairs(q_pos, q_doc, keys[0], keys[1]).any():
                self.steps_skipped += 1
                continue  # every key of this shard is in another document or after the queries
            k_s, v_s = kv[0], kv[1]
            if self.n_rep > 1:
                k_s, v_s = (t.repeat_interleave(self.n_rep, dim=1) for t in (k_s, v_s))
            args = (q, k_s, v_s, q_pos, q_doc, keys[0], keys[1])
            out, lse = checkpoint(_partial, *args, use_reentrant=False)
            outs.append(out)
            lses.append(lse)
        weights = torch.stack(lses).softmax(dim=0)  # [steps, B, H, L]: each shard's share
        out = sum(w[..., None] * o for w, o in zip(weights, outs))
        # The last shard received joins the graph even when skipped, so every rank runs the
        # backward of every shift (its peer waits for that gradient).
        return out + 0.0 * kv.reshape(-1)[0]  # type: ignore[no-any-return]
