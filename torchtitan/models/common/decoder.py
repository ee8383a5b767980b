"""The decoder skeleton the families share (docs/extending.md): grouped-query attention with
RoPE (and optional QK-norm), the SwiGLU feed-forward, the pre-norm block, and :class:`Decoder`,
the embedding -> blocks -> norm -> output module with its init plan.

Parallelism is applied from outside, so the modules are written to survive it:

* Attention derives the number of local heads from tensor shapes, so column-sharded
  ``wq``/``wk``/``wv`` (tensor parallel) work unchanged.
* The attention math lives in a swappable submodule, ``Attention.core`` (context parallel);
  it is the shared ``models/common/attention.py`` core (causal or block-causal masks).
* Blocks sit in an ``nn.ModuleDict`` keyed ``"0".."n_layers-1"``; a pipeline stage deletes the
  blocks it does not own and may set ``tok_embeddings``, ``norm`` or ``output`` to ``None``,
  and parameter names stay the same as in the full model.
* Initialization is a per-parameter plan (``weight_init_plan``) fed to
  ``init_params_deterministic``, so the values do not depend on the parallel layout.

A family subclasses :class:`Decoder`, builds its blocks and says how its RoPE table is computed
(``_compute_freqs_cis``); it may change the depth used by the output projections' init
(``_init_depth``) and extend the block init table (``block_init``).
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torchtitan.distributed.init_weights import ParamInit, init_params_deterministic
from torchtitan.models.common.attention import (
    AttentionCore,
    OptMask,
    allowed_keys,
    build_attention_mask,
)
from torchtitan.models.common.kv_cache import KVCache, LayerKVCache, OptCache
from torchtitan.models.common.moe import MoE
from torchtitan.models.common.rope import apply_rotary_emb, repeat_kv


class DecoderArgs(Protocol):
    """What :class:`Decoder` reads of a family's arguments."""

    dim: int
    n_layers: int
    vocab_size: int
    norm_eps: float
    tie_word_embeddings: bool
    attn_backend: str


class Attention(nn.Module):
    """Multi-head attention with grouped-query key/value heads and rotary embeddings; with
    ``qk_norm_eps`` set, queries and keys get a per-head RMSNorm before RoPE (QK-norm); ``bias``
    gives the four projections biases (GPT-OSS); ``window`` limits each query to that many keys
    back (Qwen3's sliding window, ``attention.py: allowed_keys``)."""

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        qk_norm_eps: float | None = None,
        bias: bool = False,
        window: int | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=bias)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=bias)
        self.q_norm: nn.RMSNorm | None = None
        self.k_norm: nn.RMSNorm | None = None
        if qk_norm_eps is not None:
            self.q_norm = nn.RMSNorm(head_dim, eps=qk_norm_eps)
            self.k_norm = nn.RMSNorm(head_dim, eps=qk_norm_eps)
        self.core = AttentionCore(window)

    def forward(
        self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: OptMask = None, cache: OptCache = None
    ) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        # -1, not n_heads: under tensor parallel these hold only this rank's heads.
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            xq, xk = self.q_norm(xq), self.k_norm(xk)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        if cache is not None:  # generation: attend to the cached positions too
            xk, xv = cache.update(xk, xv)
        n_rep = xq.shape[2] // xk.shape[2]
        q = xq.transpose(1, 2)
        k = repeat_kv(xk, n_rep).transpose(1, 2)
        v = repeat_kv(xv, n_rep).transpose(1, 2)
        out = self.core(q, k, v, mask) if cache is None else self.attend_cached(q, k, v)
        return self.wo(out.transpose(1, 2).contiguous().view(bs, seqlen, -1))  # out: [B, H, S, Dh]

    def attend_cached(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Generation: the newest queries over every cached key (``kv_cache.py``); a family
        whose core is not plain causal attention overrides it."""
        window = getattr(self.core, "window", None)
        if window is None:
            return LayerKVCache.attend(q, k, v)
        s_q, s_k = q.shape[2], k.shape[2]
        q_pos = torch.arange(s_k - s_q, s_k, device=q.device)
        keep = allowed_keys(q_pos, torch.arange(s_k, device=q.device), window, None)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


class TransformerBlock(nn.Module):
    """Pre-norm residual block: ``h = x + attn(norm(x)); out = h + ffn(norm(h))``."""

    def __init__(
        self, dim: int, norm_eps: float, attention: nn.Module, feed_forward: nn.Module | None
    ) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim, eps=norm_eps)
        self.attention = attention
        self.ffn_norm = nn.RMSNorm(dim, eps=norm_eps)
        self.feed_forward = feed_forward

    def ffn(self) -> nn.Module:
        """The block's feed-forward (a family keeping it under another name overrides this)."""
        assert self.feed_forward is not None
        return self.feed_forward

    def forward(
        self, x: torch.Tensor, freqs_cis: torch.Tensor, mask: OptMask = None, cache: OptCache = None
    ) -> torch.Tensor:
        # mask and cache by keyword: tensor parallel prepares only (x, freqs_cis).
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask=mask, cache=cache)
        return h + self.ffn()(self.ffn_norm(h))


# Parameter-name suffix inside a block -> init kind: "in" (std 0.02), "out" (depth-scaled),
# "one" (norm weights), "zero" (biases). The MoE entries are the shared layer's
# (models/common/moe.py).
BLOCK_INIT: Mapping[str, str] = {
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
# Segments that wrappers (torch.compile, activation checkpointing) insert into parameter names.
_WRAPPER_SEGMENTS = ("_orig_mod.", "_checkpoint_wrapped_module.")


class Decoder(nn.Module, abc.ABC):
    """Decoder-only transformer: embedding, the given blocks, final RMSNorm, output projection.

    Any of ``tok_embeddings``, ``norm`` and ``output`` may be ``None`` (pipeline stages): the
    forward then takes hidden states ``[B, S, dim]`` instead of token ids, and/or returns the
    hidden states instead of logits.
    """

    tok_embeddings: nn.Embedding | None
    norm: nn.RMSNorm | None
    output: nn.Linear | None
    freqs_cis: torch.Tensor
    block_init: Mapping[str, str] = BLOCK_INIT

    def __init__(self, args: DecoderArgs, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): block for i, block in enumerate(blocks)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("freqs_cis", self._compute_freqs_cis(None), persistent=False)

    @abc.abstractmethod
    def _compute_freqs_cis(self, device: torch.device | str | None) -> torch.Tensor:
        """The complex RoPE table ``[max_seq_len, head_dim // 2]`` on ``device``."""

    def _apply(self, fn: Callable[[torch.Tensor], Any], recurse: bool = True) -> Decoder:
        # ``nn.Module._apply`` converts each module's parameters separately, so moving the model
        # (to_empty from meta in particular) would untie a shared embedding/output matrix, and a
        # dtype cast (model.to(torch.bfloat16)) would turn the complex RoPE table real: put both
        # back.
        super()._apply(fn, recurse)
        if not self.freqs_cis.is_complex():
            self.freqs_cis = self._compute_freqs_cis(self.freqs_cis.device)
        emb, out = self.tok_embeddings, self.output
        if (
            self.args.tie_word_embeddings
            and emb is not None
            and out is not None
            and out.weight is not emb.weight
        ):
            out.weight = emb.weight
        return self

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``tokens``: int ids ``[B, S]`` (or hidden states ``[B, S, dim]`` when this stage has no
        embedding). ``positions``: global token positions for RoPE, int64 ``[S]`` or ``[B, S]``;
        default ``arange(S)`` (per-document positions come in here too). ``doc_ids``: int
        ``[B, S]`` document index of each token: attention is then block-causal (within a
        document only, docs/attention.md); ``None`` is plain causal. Returns logits
        ``[B, S, vocab]`` (or hidden states, see class doc). ``cache``: generation only
        (``kv_cache.py``); ``tokens`` then continue the cached sequence and ``positions`` must
        say where.
        """
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        h, freqs_cis, mask = self.run_blocks(h, positions, doc_ids, cache)
        return self._head(h, tokens, freqs_cis, mask, cache)

    def run_blocks(
        self, h: Tensor, positions: Tensor | None, doc_ids: Tensor | None, cache: KVCache | None
    ) -> tuple[Tensor, Tensor, OptMask]:
        """Hidden states ``h`` through this stage's blocks; returns them with the RoPE table and
        the attention mask the blocks used (the head and a family's extra modules reuse them)."""
        seqlen = h.shape[1]
        freqs_cis = self.freqs_cis[:seqlen] if positions is None else self.freqs_cis[positions]
        mask = (
            None
            if doc_ids is None
            else build_attention_mask(doc_ids, self.args.attn_backend, positions)
        )
        for key, layer in self.layers.items():
            if cache is None:
                h = layer(h, freqs_cis, mask=mask)
            else:
                h = layer(h, freqs_cis, mask=mask, cache=cache.layer(key))
        return h, freqs_cis, mask

    def _head(
        self, h: Tensor, tokens: Tensor, freqs_cis: Tensor, mask: OptMask, cache: KVCache | None
    ) -> Tensor:
        """The last block's hidden states ``h`` through the final norm and the output projection
        (those this stage has); a family with further heads (DeepSeek-V3's MTP) extends it."""
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """(Re)compute ``freqs_cis`` on ``device`` (default: where the buffer is now) and zero
        the MoE layers' load counters (statistics of the steps since a log, never state).

        Needed after ``to_empty``, which leaves buffers uninitialized. The routing bias is
        state: a checkpoint's (loaded before or after this call), or zero from ``init_weights``.
        """
        target = self.freqs_cis.device if device is None else torch.device(device)
        self.freqs_cis = self._compute_freqs_cis(target)
        for module in self.modules():
            if isinstance(module, MoE):
                module.tokens_per_expert.zero_()
                module.load_since_log.zero_()
                module.aux_since_log.zero_()

    def _init_depth(self, layer_id: int) -> int:
        """The depth that scales the init of block ``layer_id``'s output projections."""
        return layer_id + 1

    def _rule(self, fqn: str) -> ParamInit:
        dim, tied = self.args.dim, self.args.tie_word_embeddings
        output_rule = ParamInit("trunc_normal", std=dim**-0.5)
        if fqn == "tok_embeddings.weight":
            # A tied matrix is also the output projection; std 1.0 there would make the initial
            # logits ~sqrt(dim) in scale, so the output rule wins.
            return output_rule if tied else ParamInit("normal", std=1.0)
        if fqn == "output.weight":
            return output_rule
        if fqn == "norm.weight":
            return ParamInit("ones")
        parts = fqn.split(".", 2)
        kind = self.block_init.get(parts[2]) if len(parts) == 3 and parts[0] == "layers" else None
        if kind == "one":
            return ParamInit("ones")
        if kind == "zero":
            return ParamInit("zeros")
        if kind == "in":
            return ParamInit("trunc_normal", std=0.02)
        if kind == "out":
            depth = self._init_depth(int(parts[1]))
            return ParamInit("trunc_normal", std=0.02 / math.sqrt(2 * depth))
        raise KeyError(f"no init rule for parameter {fqn!r}")

    def weight_init_plan(self) -> dict[str, ParamInit]:
        """``fqn -> ParamInit`` for every parameter present now (tied weights once).

        Names are the plain module paths (wrapper segments of torch.compile / activation
        checkpointing removed), matching what ``init_params_deterministic`` looks up. The layer
        id used for depth-scaled init is the block's key in ``layers``.
        """
        plan: dict[str, ParamInit] = {}
        for name, _ in self.named_parameters():
            fqn = name
            for segment in _WRAPPER_SEGMENTS:
                fqn = fqn.replace(segment, "")
            plan[fqn] = self._rule(fqn)
        return plan

    def init_weights(self, seed: int = 0, buffer_device: torch.device | str | None = None) -> None:
        """``init_buffers(buffer_device)``, the MoE routing bias to zero, then every parameter
        from ``weight_init_plan``."""
        self.init_buffers(buffer_device)
        for module in self.modules():
            if isinstance(module, MoE):
                module.router.expert_bias.zero_()
        init_params_deterministic(self, self.weight_init_plan(), seed)
