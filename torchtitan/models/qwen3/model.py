"""The Qwen3 transformer (dense and MoE) as a plain ``nn.Module`` (architecture only).

The decoder skeleton is the shared one of ``models/common/decoder.py`` (the same as Llama 3's:
blocks in an ``nn.ModuleDict``, ``None`` roots on pipeline stages, heads derived from tensor
shapes, a swappable attention core, a per-parameter init plan). What is Qwen3's own is the
per-head RMSNorm of queries and keys before RoPE (QK-norm), the free ``head_dim``, and the
optional Mixture-of-Experts feed-forward (``models/common/moe.py``).

RoPE rotates adjacent channel pairs (as in Llama 3 here); Hugging Face's Qwen3 rotates the two
halves of a head. ``hf.py`` permutes ``wq``/``wk`` rows and the QK-norm weights
between the two layouts, so the models compute the same function.
"""

from __future__ import annotations

import torch
from torch import nn

from torchtitan.models.common.decoder import Attention, Decoder, TransformerBlock
from torchtitan.models.common.feed_forward import FeedForward
from torchtitan.models.common.moe import MoE
from torchtitan.models.common.rope import scaled_freqs_cis
from torchtitan.models.qwen3.args import Qwen3Args


def _block(layer_id: int, args: Qwen3Args) -> nn.Module:
    """Pre-norm block with QK-norm attention; the feed-forward is a SwiGLU or the MoE layer."""
    attention = Attention(
        args.dim,
        args.n_heads,
        args.n_kv_heads,
        args.head_dim,
        qk_norm_eps=args.norm_eps,
        window=args.window(layer_id),
    )
    feed_forward: nn.Module
    if args.moe is not None and args.is_moe_layer(layer_id):
        feed_forward = MoE(args.dim, args.moe)
    else:
        feed_forward = FeedForward(args.dim, args.intermediate_size)
    return TransformerBlock(args.dim, args.norm_eps, attention, feed_forward)


class Transformer(Decoder):
    """Qwen3 decoder: embedding, ``n_layers`` blocks, final RMSNorm, output projection (any of
    the three may be ``None`` on a pipeline stage; ``models/common/decoder.py``)."""

    args: Qwen3Args

    def __init__(self, args: Qwen3Args) -> None:
        super().__init__(args, [_block(i, args) for i in range(args.n_layers)])

    def _compute_freqs_cis(self, device: torch.device | str | None) -> torch.Tensor:
        a = self.args
        return scaled_freqs_cis(a.head_dim, a.max_seq_len, a.rope_theta, a.rope_scaling, device)
