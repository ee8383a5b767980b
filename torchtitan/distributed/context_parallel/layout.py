"""Which tokens of a sequence each context-parallel rank holds: the load balancers
(``parallelism.context_parallel_load_balancer``) and the attention cost they balance
(docs/context_parallel.md, "Load balancing packed documents").

Every balancer is an *order* of the ``S`` positions of a sample followed by the head-tail split
of that order: the order is cut into ``2 * cp`` chunks of ``c = S / (2 * cp)`` positions and cp
rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r``. So every rank holds exactly ``S / cp``
tokens whatever the documents are (the K/V all-gather needs equal shapes).

* ``headtail``: the order is the sequence itself (``arange(S)``). Under causal attention, or
  one long document, every rank does the same work.
* ``document``: per-document head-tail. Each document (a run of equal document ids) of ``n``
  tokens is cut into ``2 * cp`` pieces of about ``n / (2 * cp)`` tokens; the order lists every
  document's piece 0, then every document's piece 1, ... (positions ascending within a piece).
  The head-tail split of that order gives rank ``r`` about pieces ``r`` and ``2 * cp - 1 - r``
  of *every* document, so each document's causal work is balanced as a lone sequence's is.
  Pieces stay contiguous runs of tokens (good for block-sparse kernels).

The cost of a rank is the number of (query, key) pairs its queries attend to under block-causal
masking: a token at position ``p`` within its document attends to ``p + 1`` keys. Attention
FLOPs are this count times ``4 x head_dim x n_heads`` per layer, so ``max / mean`` of the cost
over the cp ranks is the attention imbalance (the slowest rank sets the step time).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

__all__ = [
    "BALANCERS",
    "DocumentMask",
    "document_pairs",
    "document_order",
    "doc_ids_from_lengths",
    "imbalance",
    "positions_in_documents",
    "rank_costs",
    "shard_index",
    "take_tokens",
    "window_imbalance",
]

BALANCERS = ("headtail", "document")
"""The values of ``parallelism.context_parallel_load_balancer``."""


def positions_in_documents(doc_ids: torch.Tensor) -> torch.Tensor:
    """Position of every token within its document (int64 ``[B, S]``), documents being runs of
    equal ids: 0 where a run starts."""
    seq = torch.arange(doc_ids.shape[1], device=doc_ids.device).expand_as(doc_ids)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    start_pos = torch.where(starts, seq, torch.zeros_like(seq)).cummax(dim=1).values
    return seq - start_pos


def document_order(doc_ids: torch.Tensor, cp: int) -> torch.Tensor:
    """The ``document`` balancer's order of each sample's positions (int64 ``[B, S]``): by the
    piece of its document a token falls in (``2 * cp`` pieces per document), then by position."""
    seq = doc_ids.shape[1]
    pos = positions_in_documents(doc_ids)
    length = pos + positions_in_documents(doc_ids.flip(1)).flip(1) + 1  # of each token's doc
    piece = pos * (2 * cp) // length  # 0 .. 2cp-1
    key = piece * seq + torch.arange(seq, device=doc_ids.device)
    return key.argsort(dim=1)


def shard_index(
    seq_len: int, cp: int, rank: int, balancer: str, doc_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """Global positions of the tokens cp rank ``rank`` holds, in the order it holds them:
    ``[S / cp]`` for ``headtail``, ``[B, S / cp]`` for ``document`` (which needs ``doc_ids``)."""
    if balancer not in BALANCERS:
        raise ValueError(f"unknown context parallel load balancer {balancer!r}: {BALANCERS}")
    c = seq_len // (2 * cp)
    tail = (2 * cp - 1 - rank) * c
    if balancer == "headtail":
        device = None if doc_ids is None else doc_ids.device
        order = torch.arange(seq_len, device=device)
        return torch.cat([order[rank * c : (rank + 1) * c], order[tail : tail + c]])
    if doc_ids is None:
        raise ValueError("the document load balancer needs the document ids")
    order = document_order(doc_ids, cp)
    return torch.cat([order[:, rank * c : (rank + 1) * c], order[:, tail : tail + c]], dim=1)


def take_tokens(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x`` (``[B, S, ...]``) at ``index`` along the sequence: ``[L]`` (the same positions for
    every sample) or ``[B, L]`` (per sample)."""
    if index.dim() == 1:
        return x.index_select(1, index.to(x.device))
    idx = index.to(x.device).view(*index.shape, *([1] * (x.dim() - 2)))
    return x.gather(1, idx.expand(*index.shape, *x.shape[2:]))


def rank_costs(doc_ids: torch.Tensor, cp: int, balancer: str) -> torch.Tensor:
    """Block-causal attention pairs each cp rank computes for the samples ``doc_ids``
    (``[B, S]``), summed over the batch: float64 ``[cp]``."""
    pairs = (positions_in_documents(doc_ids) + 1).double()
    costs = [
        take_tokens(pairs, shard_index(doc_ids.shape[1], cp, r, balancer, doc_ids)).sum()
        for r in range(cp)
    ]
    return torch.stack(costs)


def imbalance(costs: torch.Tensor) -> float:
    """``max / mean`` of the per-rank costs: 1.0 is perfectly balanced."""
    return float(costs.max() / costs.mean())


def window_imbalance(
    lengths: Sequence[int], seq_len: int, cp: int, balancer: str, windows: int = 64
) -> torch.Tensor:
    """:func:`imbalance` of :func:`rank_costs` for each of up to ``windows`` windows of
    ``seq_len`` tokens packed from documents of ``lengths`` (repeated as needed to fill 4
    windows), float64 ``[windows]``: how much longer than an even split the slowest cp rank's
    attention takes in each step. The load balancer's cost, and the planner's
    (``planner/cost_model.py``), the benchmark's (``benchmarks/cp_documents.py``)."""
    reps = max(1, 4 * seq_len // max(1, sum(lengths)) + 1)
    ids = doc_ids_from_lengths(list(lengths) * reps, seq_len)[:windows]
    per = torch.stack([rank_costs(w[None], cp, balancer) for w in ids])  # [windows, cp]
    return per.max(dim=1).values / per.mean(dim=1)


def doc_ids_from_lengths(lengths: list[int], seq_len: int) -> torch.Tensor:
    """Documents of the given lengths packed in order into windows of ``seq_len`` tokens, as
    the data loader packs them (a document continues into the next window): ``[B, seq_len]``
    document ids, the last partial window dropped."""
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    windows = ids[: len(ids) // seq_len * seq_len].view(-1, seq_len)
    return windows - windows[:, :1]


class DocumentMask(Protocol):
    """What the all-gather core needs of the model's attention mask (``AttentionMask`` in
    ``models/common/attention.py``): this rank's document ids and the positions the model
    rotated them by (RoPE; ``None`` means the head-tail global positions)."""

    @property
    def doc_ids(self) -> torch.Tensor: ...

    @property
    def positions(self) -> torch.Tensor | None: ...


def document_pairs(
    q_pos: torch.Tensor, q_doc: torch.Tensor, k_pos: torch.Tensor, k_doc: torch.Tensor
) -> torch.Tensor:
    """Bool ``[B, Lq, Lk]``: query ``i`` may attend to key ``j`` (same document, at or before
    it). The model's block-causal mask (``document_causal_mask_mod``) at explicit positions."""
    same_doc = k_doc[:, None, :] == q_doc[:, :, None]
    return same_doc & (k_pos[:, None, :] <= q_pos[:, :, None])
