"""Context parallel: the sequence of every sample is split over the ``cp`` mesh axis.

Layout (head-tail load balancing). The sequence of ``S`` tokens is cut into ``2 * cp`` chunks of
``c = S / (2 * cp)`` tokens; cp rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r``, in that
order. Under causal attention chunk ``g`` attends to ``g + 1`` chunks of keys, so every rank does
the same work: ``(r + 1) + (2 * cp - r) = 2 * cp + 1`` chunk pairs (a plain split would give the
last rank ``2 * cp - 1`` times the first rank's work).

Two methods (``parallelism.context_parallel_method``):

* ``allgather`` (default, any device): inputs, labels and RoPE positions are sharded as above;
  each attention layer all-gathers K and V over ``cp`` (autograd: the backward reduce-scatters
  their gradients) and masks causally by *global* positions. Exact: the same softmax as one
  process, up to floating-point reduction order. Queries stay local, so activation memory per
  rank falls with ``cp``; only one layer's full K/V is alive at a time. Under block-causal
  masking (docs/attention.md) the document ids are sharded like the tokens and all-gathered
  with K/V, and the mask is the model's own mask evaluated at global positions and documents.
* ``ring``: for causal attention (CUDA only), torch's experimental ``context_parallel`` (ring
  attention, K/V rotated with ``context_parallel_rotate_method``), which patches SDPA and
  shards inputs, labels and the RoPE table in place for the duration of forward and backward
  (torch 2.13 has no sharding rule for CPU SDPA, hence a ConfigError there). torch's ring has
  no document mask: block_causal rings run ``ring.py`` (any device), sharded as ``allgather``.

Which tokens a rank holds is the load balancer's choice (``layout.py``): ``headtail`` above, or
``document`` (head-tail within every packed document), applied per sample to every ``[B, S]``
input at once (``ContextParallel.shard``).

The loss is a mean over each rank's tokens (equal counts on every cp rank), and FSDP shards and
averages gradients over ``dp_shard x cp``, so the gradient is the global-batch mean as without CP.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.checkpoint import checkpoint

from torchtitan.distributed.context_parallel.flex import FLEX_BLOCK, flex_document_attention
from torchtitan.distributed.context_parallel.layout import (
    DocumentMask,
    document_pairs,
    shard_index,
    take_tokens,
)
from torchtitan.distributed.context_parallel.ring import RingDocumentAttention
from torchtitan.tools.torch_compat import all_gather_autograd

__all__ = [
    "AllGatherKVAttention",
    "ContextParallel",
    "apply_cp",
    "chunk_order",
    "load_balanced_positions",
    "shard_sequence",
    "unshard_sequence",
]


QUERY_BLOCK = 512
"""Queries per block of the block-causal all-gather core: each block attends only to the key
columns some of its queries may see (the rest, other documents' keys, are skipped)."""


def load_balanced_positions(
    seq_len: int, cp: int, rank: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Global positions (int64 ``[seq_len / cp]``) of the tokens cp rank ``rank`` holds."""
    c = seq_len // (2 * cp)
    head = torch.arange(rank * c, (rank + 1) * c, device=device)
    tail_start = (2 * cp - 1 - rank) * c
    tail = torch.arange(tail_start, tail_start + c, device=device)
    return torch.cat([head, tail])


def shard_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's chunks ``rank`` and ``2 * cp - 1 - rank`` of ``x`` along ``dim``."""
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=dim)


def chunk_order(cp: int) -> list[int]:
    """Where global chunk ``g`` sits in the rank-ordered gather ``[r0 head, r0 tail, r1 head, ...]``."""
    return [2 * g if g < cp else 2 * (2 * cp - 1 - g) + 1 for g in range(2 * cp)]


def unshard_sequence(shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of ``shard_sequence``: the full sequence from every rank's shard (rank order)."""
    cp = len(shards)
    pieces = [p for s in shards for p in s.chunk(2, dim=dim)]
    return torch.cat([pieces[i] for i in chunk_order(cp)], dim=dim)


class AllGatherKVAttention(nn.Module):
    """Causal attention over the whole sequence for this rank's load-balanced queries.

    Takes ``q, k, v`` as ``[B, H, L, Dh]`` with ``L = S / cp`` (this rank's two chunks); K and V
    arrive with grouped-query heads already repeated ``n_rep`` times by the model, so only every
    ``n_rep``-th head is gathered (n_rep times less traffic) and the repeat is done after.
    Block-causal masks run ``document_attention`` (SDPA over query blocks, any device) or, with
    ``backend = "flex"``, FlexAttention over a ``BlockMask`` built here from the same
    (document, position) pairs (``flex.py``; the kernel takes the unrepeated K/V heads).
    """

    def __init__(
        self,
        cp_mesh: DeviceMesh,
        n_rep: int,
        query_block: int = QUERY_BLOCK,
        backend: str = "sdpa",
        flex_block: int = FLEX_BLOCK,
    ) -> None:
        super().__init__()
        self.cp_mesh = cp_mesh
        self.cp = cp_mesh.size()
        self.rank = cp_mesh.get_local_rank()
        self.n_rep = n_rep
        self.order = chunk_order(self.cp)
        self.query_block = query_block
        self.backend = backend  # block_causal: "sdpa" (query blocks) or "flex" (a BlockMask)
        self.flex_block = flex_block

    def extra_repr(self) -> str:
        return f"cp={self.cp}, rank={self.rank}, n_rep={self.n_rep}, backend={self.backend}"

    def _gather_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (``[L, ...]``, this rank's two chunks, sequence first) -> the whole sequence
        ``[S, ...]`` in global order."""
        gathered = all_gather_autograd(x.contiguous(), 0, self.cp_mesh)
        chunks = gathered.view(2 * self.cp, x.shape[0] // 2, *x.shape[1:])
        # (views and one cat: no index tensor to copy to the device in every layer)
        return torch.cat([chunks[i] for i in self.order])

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: DocumentMask | None = None
    ) -> torch.Tensor:
        cp, n_rep = self.cp, self.n_rep
        c = k.shape[2] // 2  # this rank holds two chunks of c tokens
        # One collective for K and V, sequence first: [L, 2, B, Hkv, Dh] -> [cp * L, ...].
        kv = torch.stack((k[:, ::n_rep], v[:, ::n_rep])).movedim(3, 0)
        # Rank order [r0 head, r0 tail, r1 head, ...] -> global chunk order 0..2cp-1.
        full = self._gather_sequence(kv).movedim(0, 3)  # [2, B, Hkv, S, Dh]
        k_all, v_all = full[0], full[1]
        if mask is not None and self.backend == "flex":  # grouped-query heads stay unrepeated
            return flex_document_attention(q, k_all, v_all, self._pairs(q, mask), self.flex_block)
        if n_rep > 1:
            k_all = k_all.repeat_interleave(n_rep, dim=1)
            v_all = v_all.repeat_interleave(n_rep, dim=1)
        if mask is not None:
            return self._document_masked(q, k_all, v_all, mask)
        outs = []
        for slot, g in enumerate((self.rank, 2 * cp - 1 - self.rank)):
            # Chunk g's queries see keys 0 .. (g + 1) * c - 1, the last chunk causally.
            q_g = q[:, :, slot * c : (slot + 1) * c]
            k_g, v_g = k_all[:, :, : (g + 1) * c], v_all[:, :, : (g + 1) * c]
            if g == 0:  # square: plain causal attention
                outs.append(F.scaled_dot_product_attention(q_g, k_g, v_g, is_causal=True))
            else:
                # SDPA turns a boolean mask into a float one and saves it for backward:
                # c x (g + 1) c x 4 bytes per chunk, quadratic in seq_len. Recomputing the
                # masked attention in backward keeps only q, k, v (one more attention forward).
                outs.append(checkpoint(_masked_chunk, q_g, k_g, v_g, g * c, use_reentrant=False))
        return torch.cat(outs, dim=2)

    def _document_masked(
        self, q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, mask: DocumentMask
    ) -> torch.Tensor:
        """Block-causal attention for any load balancer: the document ids and positions of
        the tokens are gathered like K/V, so every key is known by (document, position) and
        each query attends to the keys of its document at or before it. Queries go in blocks
        of ``query_block``; a block computes only the key columns one of its queries may see
        (skipping the other documents' keys), recomputed in backward like ``_masked_chunk``."""
        return document_attention(q, k_all, v_all, self._pairs(q, mask), self.query_block)

    def _pairs(
        self, q: torch.Tensor, mask: DocumentMask
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q_pos, q_doc, k_pos, k_doc)``: the (position, document) of this rank's queries
        and of every key (gathered like K/V), ``[B, L]`` and ``[B, S]``."""
        batch, local = q.shape[0], q.shape[2]
        pos = mask.positions
        if pos is None:  # the forward got no positions: the head-tail layout's
            pos = load_balanced_positions(local * self.cp, self.cp, self.rank, q.device)
        q_pos = pos.to(q.device).expand(batch, local)
        q_doc = mask.doc_ids
        k_pos = self._gather_sequence(q_pos.t().contiguous()).t()  # [B, S], as K/V
        k_doc = self._gather_sequence(q_doc.t().contiguous()).t()
        return q_pos, q_doc, k_pos, k_doc


def document_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    where: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    query_block: int = QUERY_BLOCK,
) -> torch.Tensor:
    """Block-causal attention of queries in any order over keys in any order, ``where`` =
    ``(q_pos, q_doc, k_pos, k_doc)`` (``[B, Lq]``, ``[B, Lk]``). The queries are visited in
    (document, position) order, so a block of ``query_block`` holds few documents and needs
    few key columns (a balancer's order interleaves documents); the output is put back in the
    queries' order."""
    q_pos, q_doc, k_pos, k_doc = where
    order = (q_doc.long() * 2**32 + q_pos).argsort(dim=1)  # [B, Lq]; positions < 2**32
    q_s = q.gather(2, order[:, None, :, None].expand_as(q))
    pos_s, doc_s = q_pos.gather(1, order), q_doc.gather(1, order)
    outs = []
    for start in range(0, q.shape[2], query_block):
        blk = slice(start, start + query_block)
        args = (q_s[:, :, blk], k, v, pos_s[:, blk], doc_s[:, blk], k_pos, k_doc)
        outs.append(checkpoint(_document_block, *args, use_reentrant=False))
    out = torch.cat(outs, dim=2)
    inverse = order.argsort(dim=1)
    return out.gather(2, inverse[:, None, :, None].expand(*out.shape[:3], out.shape[3]))


def _document_block(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    q_doc: torch.Tensor,
    k_pos: torch.Tensor,
    k_doc: torch.Tensor,
) -> torch.Tensor:
    """One block of queries over the key columns any of them may attend to (every query sees
    at least itself, so no row is empty)."""
    allowed = document_pairs(q_pos, q_doc, k_pos, k_doc)
    if torch.compiler.is_compiling():  # data-dependent shapes: compiled, every column is computed
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None])
    cols = allowed.any(dim=1).any(dim=0).nonzero().squeeze(1)
    if cols.numel() < k.shape[2]:
        k, v, allowed = k.index_select(2, cols), v.index_select(2, cols), allowed[:, :, cols]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None])


def _masked_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int) -> torch.Tensor:
    """Attention of queries at global positions ``offset ..`` over keys ``0 ..``, causally."""
    q_pos = torch.arange(offset, offset + q.shape[2], device=q.device)
    mask = torch.arange(k.shape[2], device=q.device)[None, :] <= q_pos[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _positions_hook(cp: int, rank: int):  # type: ignore[no-untyped-def]
    """A forward pre-hook giving the model this rank's global RoPE positions."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if len(args) == 1 and kwargs.get("positions") is None:
            local_len = args[0].shape[1]
            kwargs["positions"] = load_balanced_positions(
                local_len * cp, cp, rank, device=args[0].device
            )
        return args, kwargs

    return hook


def _core(method: str, cp_mesh: DeviceMesh, n_rep: int, attn_backend: str) -> nn.Module:
    if method == "ring":  # block_causal: our document ring (torch's ring has no such mask)
        return RingDocumentAttention(cp_mesh, n_rep)
    return AllGatherKVAttention(cp_mesh, n_rep, backend=attn_backend)


def _submodule_or_none(block: nn.Module, path: str) -> nn.Module | None:
    """``block.get_submodule(path)``, or None where a module on the path is None."""
    module: nn.Module | None = block
    for part in path.split(".") if path else []:
        module = getattr(module, part, None)
        if module is None:
            return None
    return module


def apply_cp(
    model: nn.Module,
    blocks: nn.ModuleDict,
    cp_mesh: DeviceMesh,
    attention_core: str,
    n_rep: int,
    method: str,
    document_mask: bool = False,
    attn_backend: str = "sdpa",
) -> None:
    """Make ``model`` (a whole model or a pipeline stage of one) context parallel.

    ``allgather``: in every block the module at ``attention_core`` becomes an
    ``AllGatherKVAttention`` and the model's forward receives this rank's global positions (a
    pre-hook), so RoPE rotates each token by where it sits in the full sequence. ``ring``:
    nothing changes in the model; the trainer runs forward and backward inside
    ``ContextParallel.batch``. Either way, every module of ``model`` with
    ``enable_context_parallel(cp_mesh)`` is told (the MoE layer's sequence-wise auxiliary loss
    sums its expert load over ``cp``, docs/moe.md; a linear-attention layer passes its state
    between ranks, ``linear.py``). Blocks without the attention core (a hybrid model's
    linear-attention blocks) keep their modules. ``attn_backend`` (``sdpa`` or ``flex``) is
    the all-gather core's block-causal kernel (``flex.py``; configuration refuses flex with
    ``ring``).
    """
    for module in model.modules():
        enable = getattr(module, "enable_context_parallel", None)
        if callable(enable):
            enable(cp_mesh)
    if method == "ring" and not document_mask:
        return
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    parent_path, _, name = attention_core.rpartition(".")
    for block in blocks.values():
        parent = _submodule_or_none(block, parent_path)
        if parent is None:  # a hybrid model's block without attention (linear attention)
            continue
        setattr(parent, name, _core(method, cp_mesh, n_rep, attn_backend))
    model.register_forward_pre_hook(_positions_hook(cp, rank), with_kwargs=True)


class ContextParallel:
    """What the trainer does with a batch under CP: ``with cp.batch(inputs, labels, extra) as
    (i, l, e):`` runs forward and backward on this rank's share of the sequence; ``extra`` (the
    model's ``[B, S]`` keyword inputs: document ids, positions) is sharded like the tokens."""

    def __init__(
        self,
        cp_mesh: DeviceMesh,
        method: str,
        model_parts: list[nn.Module],
        rotate_method: str = "allgather",
        rope_buffer: str | None = None,
        balancer: str = "headtail",
        whole_inputs: tuple[str, ...] = (),
    ) -> None:
        self.mesh = cp_mesh
        self.whole_inputs = frozenset(whole_inputs)
        self.cp, self.rank = cp_mesh.size(), cp_mesh.get_local_rank()
        self.method = method
        self.balancer = balancer
        self.model_parts = model_parts
        self.rope_buffer = rope_buffer
        if method == "ring":
            from torch.distributed.tensor.experimental._attention import set_rotate_method

            set_rotate_method(rotate_method)

    def shard(
        self, inputs: torch.Tensor, labels: torch.Tensor, extra: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """This rank's tokens of every ``[B, S]`` tensor, all taken at the same positions (so
        loss, labels, RoPE positions and document ids stay together); the ``whole_inputs``
        (the model plan's, e.g. images) pass unsharded. The ``document``
        balancer's positions differ per sample; the model then gets their global positions as
        ``positions`` (unless per-document ones are there already)."""
        whole = {k: t for k, t in extra.items() if k in self.whole_inputs}
        inputs, labels, sharded = self._shard(
            inputs, labels, {k: t for k, t in extra.items() if k not in self.whole_inputs}
        )
        return inputs, labels, {**sharded, **whole}

    def _shard(
        self, inputs: torch.Tensor, labels: torch.Tensor, extra: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        if self.balancer == "headtail":
            return (
                shard_sequence(inputs, self.cp, self.rank),
                shard_sequence(labels, self.cp, self.rank),
                {k: shard_sequence(t, self.cp, self.rank) for k, t in extra.items()},
            )
        doc_ids = extra["doc_ids"]  # config validation: the document balancer needs block_causal
        batch, seq = doc_ids.shape
        index = shard_index(seq, self.cp, self.rank, self.balancer, doc_ids)
        if "positions" not in extra:
            extra = {
                **extra,
                "positions": torch.arange(seq, device=doc_ids.device).expand(batch, seq),
            }
        return (
            take_tokens(inputs, index),
            take_tokens(labels, index),
            {k: take_tokens(t, index) for k, t in extra.items()},
        )

    @contextlib.contextmanager
    def batch(
        self, inputs: torch.Tensor, labels: torch.Tensor, extra: dict[str, Any] | None = None
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, dict[str, Any]]]:
        extra = extra or {}
        if self.method != "ring" or "doc_ids" in extra:  # block_causal rings run our core
            yield self.shard(inputs, labels, extra)
            return
        assert not extra, "torch's ring attention takes no extra inputs (config validation)"
        from torch.distributed.tensor.experimental import context_parallel

        # torch shards these in place (same head-tail layout) and restores the RoPE tables.
        tables = [
            t
            for p in self.model_parts
            if self.rope_buffer is not None
            and isinstance(t := getattr(p, self.rope_buffer, None), torch.Tensor)
        ]
        with context_parallel(
            self.mesh,
            buffers=[inputs, labels, *tables],
            buffer_seq_dims=[1, 1, *([0] * len(tables))],
            no_restore_buffers={inputs, labels},
        ):
            yield inputs, labels, extra
