"""The Llama 3 transformer as a plain ``nn.Module`` (architecture only).

Parallelism is applied from outside, so the module is written to survive it:

* Attention derives the number of local heads from tensor shapes, so column-sharded
  ``wq``/``wk``/``wv`` (tensor parallel) work unchanged.
* The attention math lives in a swappable submodule, ``Attention.core`` (context parallel);
  it is the shared ``models/common/attention.py`` core (causal or block-causal masks).
* Blocks sit in an ``nn.ModuleDict`` keyed ``"0".."n_layers-1"``; a pipeline stage deletes the
  blocks it does not own and may set ``tok_embeddings``, ``norm`` or ``output`` to ``None``,
  and parameter names stay the same as in the full model.
* Initialization is a per-parameter plan (``weight_init_plan``) fed to
  ``init_params_deterministic``, so the values do not depend on the parallel layout.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.distributed.init_weights import ParamInit, init_params_deterministic
from torchtitan.models.common.attention import AttentionCore, AttentionMask, build_attention_mask
from torchtitan.models.llama3.args import ModelArgs
from torchtitan.models.llama3.kv_cache import KVCache, LayerKVCache


def _scale_rope_freqs(
    freqs: torch.Tensor,
    scaling_factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_seq_len: int,
) -> torch.Tensor:
    """Llama 3.1 long-context frequency scaling.

    Short wavelengths (high frequencies) are kept, long ones are divided by ``scaling_factor``,
    and the band in between blends the two linearly in ``original_max_seq_len / wavelength``.
    """
    wavelen = 2 * math.pi / freqs
    low_freq_wavelen = original_max_seq_len / low_freq_factor
    high_freq_wavelen = original_max_seq_len / high_freq_factor
    smooth = (original_max_seq_len / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    blended = (1 - smooth) * freqs / scaling_factor + smooth * freqs
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / scaling_factor, blended)
    return torch.where(wavelen < high_freq_wavelen, freqs, scaled)


def precompute_freqs_cis(
    head_dim: int,
    end: int,
    theta: float = 500000.0,
    scaling_factor: float | None = None,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_max_seq_len: int = 8192,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Rotary embedding table: ``complex64 [end, head_dim // 2]``, entry ``[p, i]`` is
    ``exp(1j * p * theta ** (-2i / head_dim))`` (with Llama 3.1 scaling when a factor is set)."""
    exponents = torch.arange(0, head_dim, 2, device=device)[: head_dim // 2].float() / head_dim
    freqs = 1.0 / (theta**exponents)
    if scaling_factor is not None:
        freqs = _scale_rope_freqs(
            freqs, scaling_factor, low_freq_factor, high_freq_factor, original_max_seq_len
        )
    positions = torch.arange(end, device=device, dtype=torch.float32)
    angles = torch.outer(positions, freqs)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rotary_emb(
    xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``xq`` / ``xk`` (``[B, S, H, Dh]``) by ``freqs_cis`` (``[S, Dh/2]`` or ``[B, S, Dh/2]``).

    Consecutive pairs of channels are treated as one complex number.
    """
    if freqs_cis.dim() == 2:  # [S, Dh/2] -> [1, S, 1, Dh/2]
        freqs = freqs_cis[None, :, None, :]
    else:  # [B, S, Dh/2] -> [B, S, 1, Dh/2]
        freqs = freqs_cis[:, :, None, :]
    q = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    k = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    q_out = torch.view_as_real(q * freqs).flatten(3)
    k_out = torch.view_as_real(k * freqs).flatten(3)
    return q_out.type_as(xq), k_out.type_as(xk)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """``[B, S, Hkv, Dh] -> [B, S, Hkv * n_rep, Dh]``, each kv head repeated ``n_rep`` times."""
    if n_rep == 1:
        return x
    bs, seqlen, n_kv, head_dim = x.shape
    return (
        x[:, :, :, None, :]
        .expand(bs, seqlen, n_kv, n_rep, head_dim)
        .reshape(bs, seqlen, n_kv * n_rep, head_dim)
    )


class Attention(nn.Module):
    """Multi-head attention with grouped-query key/value heads and rotary embeddings."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
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
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        if cache is not None:  # generation: attend to the cached positions too
            xk, xv = cache.update(xk, xv)
        n_rep = xq.shape[2] // xk.shape[2]
        q = xq.transpose(1, 2)
        k = repeat_kv(xk, n_rep).transpose(1, 2)
        v = repeat_kv(xv, n_rep).transpose(1, 2)
        out = self.core(q, k, v, mask) if cache is None else cache.attend(q, k, v)  # [B, H, S, Dh]
        out = out.transpose(1, 2).contiguous().view(bs, seqlen, -1)
        return self.wo(out)


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: ``h = x + attn(norm(x)); out = h + ffn(norm(h))``."""

    def __init__(self, layer_id: int, args: ModelArgs) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.hidden_dim)

    def forward(
        self,
        x: torch.Tensor,
        freqs_cis: torch.Tensor,
        mask: AttentionMask | None = None,
        cache: LayerKVCache | None = None,
    ) -> torch.Tensor:
        # mask and cache by keyword: tensor parallel prepares only (x, freqs_cis).
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask=mask, cache=cache)
        return h + self.feed_forward(self.ffn_norm(h))


# Parameter-name suffixes inside a block, by init rule.
_INPUT_PROJECTIONS = (
    "attention.wq.weight",
    "attention.wk.weight",
    "attention.wv.weight",
    "feed_forward.w1.weight",
)
_OUTPUT_PROJECTIONS = ("attention.wo.weight", "feed_forward.w2.weight", "feed_forward.w3.weight")
_BLOCK_NORMS = ("attention_norm.weight", "ffn_norm.weight")
# Segments that wrappers (torch.compile, activation checkpointing) insert into parameter names.
_WRAPPER_SEGMENTS = ("_orig_mod.", "_checkpoint_wrapped_module.")


def restore_after_apply(model: Any) -> None:
    """What ``nn.Module._apply`` undoes, put back (a decoder's ``_apply`` calls this after
    ``super()._apply``): it converts each module's parameters separately, so moving the model
    (to_empty from meta in particular) would untie a shared embedding/output matrix, and a dtype
    cast (model.to(torch.bfloat16)) would turn the complex RoPE table real. ``model`` has
    ``args.tie_word_embeddings``, ``tok_embeddings``, ``output``, ``freqs_cis`` and
    ``_compute_freqs_cis(device)``."""
    if not model.freqs_cis.is_complex():
        model.freqs_cis = model._compute_freqs_cis(model.freqs_cis.device)
    if (
        model.args.tie_word_embeddings
        and model.tok_embeddings is not None
        and model.output is not None
        and model.output.weight is not model.tok_embeddings.weight
    ):
        model.output.weight = model.tok_embeddings.weight


class Transformer(nn.Module):
    """Llama 3 decoder: embedding, ``n_layers`` blocks, final RMSNorm, output projection.

    Any of ``tok_embeddings``, ``norm`` and ``output`` may be ``None`` (pipeline stages): the
    forward then takes hidden states ``[B, S, dim]`` instead of token ids, and/or returns the
    hidden states instead of logits.
    """

    tok_embeddings: nn.Embedding | None
    norm: nn.RMSNorm | None
    output: nn.Linear | None
    freqs_cis: torch.Tensor

    def __init__(self, args: ModelArgs) -> None:
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
        return precompute_freqs_cis(
            a.head_dim,
            a.max_seq_len,
            theta=a.rope_theta,
            scaling_factor=a.rope_scaling_factor,
            low_freq_factor=a.rope_low_freq_factor,
            high_freq_factor=a.rope_high_freq_factor,
            original_max_seq_len=a.rope_original_max_seq_len,
            device=device,
        )

    def _apply(self, fn: Callable[[torch.Tensor], Any], recurse: bool = True) -> Transformer:
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
        """``tokens``: int ids ``[B, S]`` (or hidden states ``[B, S, dim]`` when this stage has no
        embedding). ``positions``: global token positions for RoPE, int64 ``[S]`` or ``[B, S]``;
        default ``arange(S)`` (per-document positions come in here too). ``doc_ids``: int
        ``[B, S]`` document index of each token: attention is then block-causal (within a
        document only, docs/attention.md); ``None`` is plain causal. Returns logits ``[B, S, vocab]`` (or hidden states, see class doc).
        ``cache``: generation only (``kv_cache.py``); ``tokens`` then continue the cached
        sequence and ``positions`` must say where.
        """
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        seqlen = h.shape[1]
        if positions is None:
            freqs_cis = self.freqs_cis[:seqlen]
        else:
            freqs_cis = self.freqs_cis[positions]
        mask = None if doc_ids is None else build_attention_mask(doc_ids, self.args.attn_backend)
        for key, layer in self.layers.items():
            if cache is None:
                h = layer(h, freqs_cis, mask=mask)
            else:
                h = layer(h, freqs_cis, mask=mask, cache=cache.layer(key))
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """(Re)compute ``freqs_cis`` on ``device`` (default: where the buffer is now).

        Needed after ``to_empty``, which leaves buffers uninitialized.
        """
        target = self.freqs_cis.device if device is None else torch.device(device)
        self.freqs_cis = self._compute_freqs_cis(target)

    def _rule(self, fqn: str) -> ParamInit:
        args = self.args
        tied = args.tie_word_embeddings
        output_rule = ParamInit("trunc_normal", std=args.dim**-0.5)
        if fqn == "tok_embeddings.weight":
            # A tied matrix is also the output projection; std 1.0 there would make the initial
            # logits ~sqrt(dim) in scale, so the output rule wins.
            return output_rule if tied else ParamInit("normal", std=1.0)
        if fqn == "output.weight":
            return output_rule
        if fqn == "norm.weight":
            return ParamInit("ones")
        parts = fqn.split(".", 2)
        if len(parts) == 3 and parts[0] == "layers":
            layer_id, suffix = int(parts[1]), parts[2]
            if suffix in _BLOCK_NORMS:
                return ParamInit("ones")
            if suffix in _INPUT_PROJECTIONS:
                return ParamInit("trunc_normal", std=0.02)
            if suffix in _OUTPUT_PROJECTIONS:
                depth = layer_id + 1 if args.depth_init else args.n_layers
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
        """``init_buffers(buffer_device)``, then every parameter from ``weight_init_plan``."""
        self.init_buffers(buffer_device)
        init_params_deterministic(self, self.weight_init_plan(), seed)
