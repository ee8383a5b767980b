"""GPT-OSS attention: learned per-head sinks and an optional sliding window (docs/gpt_oss.md).

A sink is one extra logit per head in every query's softmax with no value behind it: the
weights of the real keys sum to ``Z / (Z + exp(sink))`` (``Z`` the sum over the keys), so a head
can attend to nothing. The window keeps key ``j`` for query ``i`` when ``0 <= i - j < window``.
Both compose with the block-causal document mask (``models/common/attention.py``).

Two kernels compute the same function:

* ``eager`` (any device, the exact path with backward everywhere): scores, the mask (causal,
  window, documents) as ``-inf``, the sink column appended, softmax, the sink column dropped;
* ``flex`` (CUDA): FlexAttention over a ``BlockMask`` of the same mask, returning the log-sum-exp
  ``L`` of each query's scores; the sink then rescales the output by ``Z / (Z + exp(sink)) =
  sigmoid(L - sink)``.

The sinks live in the core (``attention.core.sinks``) so that tensor parallel shards them with
their heads (``parallel_plan.py``: ``ShardHeads``); the core sees this rank's heads only.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from torchtitan.models.common.attention import OptMask, allowed_keys, document_causal_mask_mod
from torchtitan.models.common.decoder import Attention
from torchtitan.models.common.moe_experts import local_weight
from torchtitan.models.gpt_oss.args import GptOssArgs

__all__ = ["GptOssAttention", "SinkAttentionCore", "allowed_keys"]


def eager_sink_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, keep: torch.Tensor
) -> torch.Tensor:
    """``[B, H, Lq, Dh]``: softmax over the visible keys' scores and each head's sink logit."""
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~keep, float("-inf"))
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return probs.to(v.dtype) @ v


@functools.cache
def _compiled_flex() -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def _mask_mod(window: int | None, doc_ids: torch.Tensor | None) -> Any:
    document = None if doc_ids is None else document_causal_mask_mod(doc_ids)

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        keep = kv_idx <= q_idx if document is None else document(b, h, q_idx, kv_idx)
        return keep if window is None else keep & (q_idx - kv_idx < window)

    return mask_mod


def flex_sink_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor,
    window: int | None,
    doc_ids: torch.Tensor | None,
) -> torch.Tensor:
    """FlexAttention (compiled) with the window/document mask, then the sinks' rescaling."""
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask

    batch, seq = q.shape[0], q.shape[2]
    block = create_block_mask(
        _mask_mod(window, doc_ids), None if doc_ids is None else batch, None, seq, seq, q.device
    )
    # ``return_aux`` (torch 2.11+; ``return_lse`` is deprecated there) gives the log-sum-exp.
    out, aux = _compiled_flex()(q, k, v, block_mask=block, return_aux=AuxRequest(lse=True))
    lse = aux.lse
    gate = torch.sigmoid(lse - sinks.to(lse.dtype).view(1, -1, 1))
    return out * gate[..., None].to(out.dtype)


class SinkAttentionCore(nn.Module):
    """``q, k, v`` (``[B, H, S, Dh]``, K/V heads repeated) -> attention with this core's sinks
    and window; ``backend`` ``flex`` uses FlexAttention, anything else the eager exact path."""

    def __init__(self, n_heads: int, window: int | None, backend: str = "sdpa") -> None:
        super().__init__()
        self.window = window
        self.backend = backend
        self.sinks = nn.Parameter(torch.empty(n_heads))

    def local_sinks(self) -> torch.Tensor:
        """This rank's heads' sinks (a ``Shard(0)`` DTensor under tensor parallel)."""
        return local_weight(self.sinks)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: OptMask = None
    ) -> torch.Tensor:
        doc_ids = None if mask is None else mask.doc_ids
        if self.backend == "flex":
            return flex_sink_attention(q, k, v, self.local_sinks(), self.window, doc_ids)
        pos = torch.arange(q.shape[2], device=q.device)
        return eager_sink_attention(
            q, k, v, self.local_sinks(), allowed_keys(pos, pos, self.window, doc_ids)
        )

    def attend_cached(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Generation: the newest ``Lq`` queries over all ``Lk`` cached keys (eager path)."""
        s_q, s_k = q.shape[2], k.shape[2]
        q_pos = torch.arange(s_k - s_q, s_k, device=q.device)
        k_pos = torch.arange(s_k, device=q.device)
        keep = allowed_keys(q_pos, k_pos, self.window, None)
        return eager_sink_attention(q, k, v, self.local_sinks(), keep)


class GptOssAttention(Attention):
    """The shared GQA attention with biased projections and a :class:`SinkAttentionCore`."""

    def __init__(self, a: GptOssArgs, layer_id: int) -> None:
        super().__init__(a.dim, a.n_heads, a.kv_heads, a.head_dim, bias=True)
        window = a.window(layer_id)
        self.core = SinkAttentionCore(a.n_heads, window, a.attn_backend)  # type: ignore[assignment]

    def attend_cached(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        core = self.core
        assert isinstance(core, SinkAttentionCore), "context parallel cannot swap this core"
        return core.attend_cached(q, k, v)
