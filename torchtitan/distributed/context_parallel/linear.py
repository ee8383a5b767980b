"""Recurrent (linear-attention) layers under context parallel (docs/context_parallel.md,
"Linear attention (Gated DeltaNet) under context parallel").

A recurrent layer carries a state along the sequence, so its tokens must be visited in sequence
order, and the state leaving one rank's stretch is the state entering the next rank's. Two steps:

* **Layout.** Whatever the load balancer gave a rank (head-tail chunks, or pieces of every
  document), a recurrent layer runs on the rank's *contiguous* stretch: tokens
  ``r * L .. (r + 1) * L - 1`` of the sequence (``L = S / cp``), plus the ``halo`` tokens just
  before it (a causal convolution's window). A recurrent layer's cost is linear in its tokens, so
  equal stretches are equal work. :class:`SequenceRelayout` all-gathers the layer input over
  ``cp`` and takes the stretch (the backward reduce-scatters the gradient to the owners), and
  gives the outputs back to the balancer's order the same way. The sequence order is recovered
  from the tokens' (document id, position) keys, gathered once per layer: positions order the
  tokens of a document, and document ids increase along the sequence (as every data loader
  numbers them).
* **State.** A layer whose state update is affine in the state (``S_out = P @ S_in + B`` per
  stretch, as the gated delta rule's is) computes its stretch once with an unknown entering state
  and hands over ``(P, B)``; :meth:`SequenceRelayout.incoming_state` all-gathers the pairs
  (autograd: the gradient reaches every earlier rank's pair) and chains them over the ranks
  before this one. Where a stretch starts a document the chain is cut (the state resets).
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.distributed.context_parallel.layout import DocumentMask, shard_index, take_tokens
from torchtitan.tools.torch_compat import all_gather_autograd

__all__ = ["SequenceRelayout"]


class SequenceRelayout:
    """This rank's tokens (in its load balancer's order) <-> its contiguous stretch of the
    sequence (``halo`` earlier tokens included on the way in). Built per layer call from the
    mask the attention layers get (``None``: causal, the head-tail layout)."""

    def __init__(
        self, mesh: DeviceMesh, like: torch.Tensor, mask: DocumentMask | None, halo: int = 0
    ) -> None:
        self.mesh, self.cp, self.rank = mesh, mesh.size(), mesh.get_local_rank()
        self.local = like.shape[1]
        self.halo = min(halo, self.rank * self.local)
        self._window, self._back, self.doc_ids, self._keep = self._indices(like, mask)

    @torch.compiler.disable  # integer bookkeeping; compiled, inductor's CPU code failed on it
    def _indices(
        self, like: torch.Tensor, mask: DocumentMask | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(gather index of the stretch with its halo, gather index of this rank's tokens in
        the stretches, the stretch's document ids, ``[B, cp]`` 1.0 where stretch j continues
        stretch j - 1's document)."""
        batch, local, start = like.shape[0], self.local, self.rank * self.local
        pos = None if mask is None else mask.positions
        if pos is None:  # the forward got no positions: the head-tail layout's
            pos = shard_index(local * self.cp, self.cp, self.rank, "headtail")
        pos = pos.to(like.device).long().expand(batch, local)
        doc = None if mask is None else mask.doc_ids.to(like.device).long()
        key = pos if doc is None else doc * 2**32 + pos  # positions < 2**32
        order = self.gather(key).argsort(dim=1)  # sequence index -> index in the gather
        window = order[:, start - self.halo : start + local]
        back = order.argsort(dim=1)[:, start : start + local]
        keep = torch.ones(batch, self.cp, device=like.device)
        if doc is None:
            return window, back, None, keep
        docs = take_tokens(self.gather(doc), order)  # [B, S] in sequence order
        firsts = torch.arange(1, self.cp, device=like.device) * local
        keep[:, 1:] = (docs[:, firsts] == docs[:, firsts - 1]).float()
        return window, back, docs[:, start - self.halo : start + local], keep

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, L, ...]`` of every cp rank, rank after rank: ``[B, cp * L, ...]``."""
        out = all_gather_autograd(x.transpose(0, 1).contiguous(), 0, self.mesh)
        return out.transpose(0, 1)  # type: ignore[no-any-return]

    def to_contiguous(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's ``[B, L, ...]`` (balancer order) -> its stretch ``[B, halo + L, ...]``."""
        return take_tokens(self.gather(x), self._window)

    def from_contiguous(self, y: torch.Tensor) -> torch.Tensor:
        """The stretch's outputs ``[B, L, ...]`` (no halo) -> this rank's tokens' outputs, in
        the balancer's order (the stretches, gathered rank after rank, are the sequence)."""
        return take_tokens(self.gather(y), self._back)

    def incoming_state(self, trans: torch.Tensor, contrib: torch.Tensor) -> torch.Tensor:
        """The state entering this rank's stretch, from every rank's affine map of its stretch
        ``S_out = trans @ S_in + contrib`` (``trans`` ``[B, H, D, D]``, ``contrib``
        ``[B, H, D, Dv]``): zero at the sequence start and where a stretch starts a document."""
        d = trans.shape[-1]
        pair = torch.cat([trans, contrib], dim=-1)
        every = all_gather_autograd(pair.contiguous(), 0, self.mesh)
        every = every.view(self.cp, *pair.shape)
        # Rank 0 reads no pair; the gather joins its graph anyway, so every rank runs the
        # gather's backward (the others wait for that reduce-scatter).
        state = torch.zeros_like(contrib) + 0.0 * every.reshape(-1)[0]
        for j in range(self.rank):
            state = every[j, ..., :d] @ state + every[j, ..., d:]
            state = state * self._keep[:, j + 1, None, None, None]
        return state
