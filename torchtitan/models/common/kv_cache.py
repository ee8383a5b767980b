"""Key/value cache for autoregressive generation (``scripts/generate.py``).

Training never builds one: ``Transformer.forward(tokens, positions, cache=None)`` is the plain
architecture. With a cache, each ``Attention`` appends this call's rotated keys and values to
its layer's buffers and attends to everything cached so far, so decoding a token costs one
position's work instead of recomputing the whole prefix.

Buffers are allocated on first use with the shape, dtype and device of the keys they receive,
so under tensor parallel each rank caches only its own heads (the column-parallel ``wk``/``wv``
hand Attention local tensors).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class LayerKVCache:
    """One attention layer's cached keys and values, ``[B, max_len, kv_heads, head_dim]``."""

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self.length = 0
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def update(self, xk: torch.Tensor, xv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``xk``/``xv`` (``[B, S, H, Dh]``, positions ``length .. length+S-1``) and
        return all cached keys and values up to and including them."""
        if self.k is None or self.v is None:
            # Each buffer takes its own trailing shape: MLA caches a latent and a rotated key
            # of different widths here (models/deepseek_v3/mla.py).
            self.k = xk.new_zeros((xk.shape[0], self.max_len, *xk.shape[2:]))
            self.v = xv.new_zeros((xv.shape[0], self.max_len, *xv.shape[2:]))
        end = self.length + xk.shape[1]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; asked for {end}")
        self.k[:, self.length : end] = xk
        self.v[:, self.length : end] = xv
        self.length = end
        return self.k[:, :end], self.v[:, :end]

    @staticmethod
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of the newest ``S_q`` positions over all ``S_k`` cached ones
        (``[B, H, S, Dh]``): query ``i`` sees keys ``0 .. S_k - S_q + i``."""
        s_q, s_k = q.shape[2], k.shape[2]
        if s_q == s_k:  # the prefill: the same computation as training
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        mask = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).tril(s_k - s_q)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


OptCache = LayerKVCache | None
"""A layer's ``cache`` argument: ``None`` outside generation."""


class KVCache:
    """The caches of all layers of one model, keyed like ``Transformer.layers``."""

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self.layers: dict[str, LayerKVCache] = {}

    def layer(self, key: str) -> LayerKVCache:
        if key not in self.layers:
            self.layers[key] = LayerKVCache(self.max_len)
        return self.layers[key]

    @property
    def length(self) -> int:
        """Positions cached so far (0 before the first forward)."""
        return next(iter(self.layers.values())).length if self.layers else 0
