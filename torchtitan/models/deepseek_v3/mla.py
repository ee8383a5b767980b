"""Multi-head latent attention (MLA), DeepSeek-V2/V3's attention (docs/deepseek_v3.md).

Training form: the latents are up-projected to per-head keys and values, then attended like
ordinary multi-head attention (``models/common/attention.py``'s swappable core, so context
parallel and the document mask work unchanged):

* queries: ``wq`` (``q_lora_rank`` 0) or ``wq_b(q_norm(wq_a(x)))``, ``[B, S, H, nope + rope]``;
* ``attention_bias``: ``wq_a``, ``wkv_a`` and ``wo`` have biases (transformers' placement);
* keys/values: ``wkv_a(x)`` gives the latent ``c`` (``kv_lora_rank``, normalized by
  ``kv_norm``) and one rotated key ``k_rope`` shared by all heads; ``wkv_b(c)`` gives each
  head's non-rotated key and its value (``v_head_dim``);
* RoPE (adjacent channel pairs, ``models/common/rope.py``) rotates only the ``rope`` part of
  queries and keys; the softmax scale (YaRN's included) is applied to the queries, so the core
  keeps SDPA's default.

Generation caches what MLA was designed to cache: per token the normalized latent and the
rotated key (``kv_lora_rank + qk_rope_head_dim`` values), not ``2 x H x head_dim``; each step
up-projects the cached latents again.

Tensor parallel (``parallel_plan.py``): the down-projections and their norms run on the
sequence shard with replicated weights; the up-projections are column-sharded by heads and
all-gather only the small latents; ``k_rope`` is gathered at ``rope_key`` (an identity here).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.common.attention import AttentionCore, OptMask
from torchtitan.models.common.kv_cache import OptCache
from torchtitan.models.common.rope import apply_rotary_emb
from torchtitan.models.deepseek_v3.args import LATENT_NORM_EPS, DeepSeekV3Args


class MLA(nn.Module):
    """``[B, S, dim] -> [B, S, dim]`` multi-head latent attention."""

    def __init__(self, a: DeepSeekV3Args) -> None:
        super().__init__()
        self.nope, self.rope, self.v_dim = a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim
        self.kv_rank = a.kv_lora_rank
        qk = a.head_dim
        bias = a.attention_bias  # transformers' placement: q_a_proj, kv_a_proj_with_mqa, o_proj
        self.wq: nn.Linear | None = None
        self.wq_a: nn.Linear | None = None
        self.q_norm: nn.RMSNorm | None = None
        self.wq_b: nn.Linear | None = None
        if a.q_lora_rank:
            self.wq_a = nn.Linear(a.dim, a.q_lora_rank, bias=bias)
            self.q_norm = nn.RMSNorm(a.q_lora_rank, eps=LATENT_NORM_EPS)
            self.wq_b = nn.Linear(a.q_lora_rank, a.n_heads * qk, bias=False)
        else:
            self.wq = nn.Linear(a.dim, a.n_heads * qk, bias=False)
        self.wkv_a = nn.Linear(a.dim, self.kv_rank + self.rope, bias=bias)
        self.kv_norm = nn.RMSNorm(self.kv_rank, eps=LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(self.kv_rank, a.n_heads * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(a.n_heads * self.v_dim, a.dim, bias=bias)
        self.rope_key = nn.Identity()
        """Where tensor parallel gathers the rotated key's sequence (``parallel_plan.py``)."""
        self.core = AttentionCore()
        # SDPA divides by sqrt(head_dim); the queries carry the rest of the softmax scale.
        self.q_scale = a.softmax_scale * math.sqrt(qk)

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if self.wq is not None:
            return self.wq(x)
        assert self.wq_a is not None and self.q_norm is not None and self.wq_b is not None
        return self.wq_b(self.q_norm(self.wq_a(x)))

    def forward(
        self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: OptMask = None, cache: OptCache = None
    ) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        # -1, not n_heads: under tensor parallel the up-projections hold this rank's heads.
        q = self._queries(x).view(bs, seqlen, -1, self.nope + self.rope)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        latent, k_rope = self.wkv_a(x).split([self.kv_rank, self.rope], dim=-1)
        latent = self.kv_norm(latent)
        k_rope = self.rope_key(k_rope).unsqueeze(2)  # [B, S, 1, rope]
        q_rope, k_rope = apply_rotary_emb(q_rope, k_rope, freqs_cis)
        if cache is not None:  # generation: cache the latent and the rotated key only
            cached, k_rope = cache.update(latent.unsqueeze(2), k_rope)
            latent = cached.squeeze(2)
        kv = self.wkv_b(latent).view(bs, latent.shape[1], -1, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        v_dim = v.shape[-1]
        if type(self.core) is not AttentionCore and v_dim < k.shape[-1]:
            # A swapped core (context parallel's all-gather) gathers K and V as one stacked
            # tensor: values padded with zero channels to the key width, cut off after.
            v = F.pad(v, (0, k.shape[-1] - v_dim))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        out = self.core(q, k, v, mask) if cache is None else cache.attend(q, k, v)
        out = out[..., :v_dim]
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))
