"""The Qwen3 transformer (dense and MoE) as a plain ``nn.Module`` (architecture only).

It follows the Llama 3 module's conventions (docs/extending.md): blocks in an ``nn.ModuleDict``,
``None`` roots on pipeline stages, heads derived from tensor shapes, a swappable attention core,
a per-parameter init plan. RoPE, the GQA repeat, the SwiGLU and the KV cache are Llama 3's (the
same math); what is Qwen3's own is the per-head RMSNorm of queries and keys before RoPE
(QK-norm), the free ``head_dim``, and the optional Mixture-of-Experts feed-forward
(``models/common/moe.py``).

RoPE rotates adjacent channel pairs (as in Llama 3 here); Hugging Face's Qwen3 rotates the two
halves of a head. ``state_dict_adapter.py`` permutes ``wq``/``wk`` rows and the QK-norm weights
between the two layouts, so the models compute the same function.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from torchtitan.distributed.init_weights import ParamInit, init_params_deterministic
from torchtitan.models.common.attention import AttentionCore, AttentionMask, build_attention_mask
from torchtitan.models.common.moe import MoE
from torchtitan.models.llama3.kv_cache import KVCache, LayerKVCache
from torchtitan.models.llama3.model import (
    FeedForward,
    apply_rotary_emb,
    precompute_freqs_cis,
    repeat_kv,
    restore_after_apply,
)
from torchtitan.models.qwen3.args import Qwen3Args


class Attention(nn.Module):
    """GQA attention with per-head RMSNorm on queries and keys (QK-norm) before RoPE."""

    def __init__(self, args: Qwen3Args) -> None:
        super().__init__()
        hd = self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * hd, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * hd, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * hd, bias=False)
        self.wo = nn.Linear(args.n_heads * hd, args.dim, bias=False)
        self.q_norm = nn.RMSNorm(hd, eps=args.norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=args.norm_eps)
        self.core = AttentionCore()

    def forward(
        self,
        x: torch.Tensor,
        freqs_cis: torch.Tensor,
        mask: AttentionMask | None = None,
        cache: LayerKVCache | None = None,
    ) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        # -1, not n_heads: under tensor parallel these hold only this rank's heads.
        xq = self.q_norm(self.wq(x).view(bs, seqlen, -1, self.head_dim))
        xk = self.k_norm(self.wk(x).view(bs, seqlen, -1, self.head_dim))
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        if cache is not None:
            xk, xv = cache.update(xk, xv)
        n_rep = xq.shape[2] // xk.shape[2]
        q = xq.transpose(1, 2)
        k = repeat_kv(xk, n_rep).transpose(1, 2)
        v = repeat_kv(xv, n_rep).transpose(1, 2)
        out = self.core(q, k, v, mask) if cache is None else cache.attend(q, k, v)
        return self.wo(out.transpose(1, 2).contiguous().view(bs, seqlen, -1))


class TransformerBlock(nn.Module):
    """Pre-norm residual block; the feed-forward is a SwiGLU or the MoE layer."""

    def __init__(self, layer_id: int, args: Qwen3Args) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward: nn.Module
        if args.moe is not None and args.is_moe_layer(layer_id):
            self.feed_forward = MoE(args.dim, args.moe)
        else:
            self.feed_forward = FeedForward(args.dim, args.intermediate_size)

    def forward(
        self,
        x: torch.Tensor,
        freqs_cis: torch.Tensor,
        mask: AttentionMask | None = None,
        cache: LayerKVCache | None = None,
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask=mask, cache=cache)
        return h + self.feed_forward(self.ffn_norm(h))


_WRAPPER_SEGMENTS = ("_orig_mod.", "_checkpoint_wrapped_module.")
# Block parameter suffix -> init kind: "in" (std 0.02), "out" (depth-scaled), "one".
_BLOCK_RULES = {
    "attention.wq.weight": "in",
    "attention.wk.weight": "in",
    "attention.wv.weight": "in",
    "attention.wo.weight": "out",
    "attention.q_norm.weight": "one",
    "attention.k_norm.weight": "one",
    "attention_norm.weight": "one",
    "ffn_norm.weight": "one",
    "feed_forward.w1.weight": "in",
    "feed_forward.w3.weight": "out",
    "feed_forward.w2.weight": "out",
    "feed_forward.router.gate.weight": "in",
    "feed_forward.experts.w1": "in",
    "feed_forward.experts.w3": "out",
    "feed_forward.experts.w2": "out",
    "feed_forward.shared.w1.weight": "in",
    "feed_forward.shared.w3.weight": "out",
    "feed_forward.shared.w2.weight": "out",
}


class Transformer(nn.Module):
    """Qwen3 decoder: embedding, ``n_layers`` blocks, final RMSNorm, output projection (any of
    the three may be ``None`` on a pipeline stage)."""

    tok_embeddings: nn.Embedding | None
    norm: nn.RMSNorm | None
    output: nn.Linear | None
    freqs_cis: torch.Tensor

    def __init__(self, args: Qwen3Args) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(i, args) for i in range(args.n_layers)}
        )
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("freqs_cis", self._compute_freqs_cis(None), persistent=False)

    def _compute_freqs_cis(self, device: torch.device | str | None) -> torch.Tensor:
        a = self.args
        return precompute_freqs_cis(a.head_dim, a.max_seq_len, theta=a.rope_theta, device=device)

    def _apply(self, fn: Callable[[torch.Tensor], Any], recurse: bool = True) -> Transformer:
        # As in Llama 3: keep the tied matrix tied and the RoPE table complex across moves/casts.
        super()._apply(fn, recurse)
        restore_after_apply(self)
        return self

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As Llama 3's ``Transformer.forward``: token ids (or hidden states on a stage without
        the embedding) -> logits (or hidden states); ``positions``, ``cache``, ``doc_ids``."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        seqlen = h.shape[1]
        freqs_cis = self.freqs_cis[:seqlen] if positions is None else self.freqs_cis[positions]
        mask = None if doc_ids is None else build_attention_mask(doc_ids, self.args.attn_backend)
        for key, layer in self.layers.items():
            layer_cache = None if cache is None else cache.layer(key)
            h = layer(h, freqs_cis, mask=mask, cache=layer_cache)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """RoPE table on ``device``; the MoE bias and load counters to zero (after
        ``to_empty``)."""
        target = self.freqs_cis.device if device is None else torch.device(device)
        self.freqs_cis = self._compute_freqs_cis(target)
        for module in self.modules():
            if isinstance(module, MoE):
                module.router.expert_bias.zero_()
                module.tokens_per_expert.zero_()
                module.load_since_log.zero_()
                module.aux_since_log.zero_()

    def _rule(self, fqn: str) -> ParamInit:
        a = self.args
        output_rule = ParamInit("trunc_normal", std=a.dim**-0.5)
        if fqn == "tok_embeddings.weight":
            return output_rule if a.tie_word_embeddings else ParamInit("normal", std=1.0)
        if fqn == "output.weight":
            return output_rule
        if fqn == "norm.weight":
            return ParamInit("ones")
        parts = fqn.split(".", 2)
        if len(parts) == 3 and parts[0] == "layers" and parts[2] in _BLOCK_RULES:
            kind = _BLOCK_RULES[parts[2]]
            if kind == "one":
                return ParamInit("ones")
            if kind == "in":
                return ParamInit("trunc_normal", std=0.02)
            return ParamInit("trunc_normal", std=0.02 / math.sqrt(2 * (int(parts[1]) + 1)))
        raise KeyError(f"no init rule for parameter {fqn!r}")

    def weight_init_plan(self) -> dict[str, ParamInit]:
        plan: dict[str, ParamInit] = {}
        for name, _ in self.named_parameters():
            fqn = name
            for segment in _WRAPPER_SEGMENTS:
                fqn = fqn.replace(segment, "")
            plan[fqn] = self._rule(fqn)
        return plan

    def init_weights(self, seed: int = 0, buffer_device: torch.device | str | None = None) -> None:
        self.init_buffers(buffer_device)
        init_params_deterministic(self, self.weight_init_plan(), seed)
