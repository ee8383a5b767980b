"""The Llama 3 transformer as a plain ``nn.Module`` (architecture only).

The decoder skeleton (GQA attention with RoPE, SwiGLU, pre-norm blocks, the embedding -> blocks
-> norm -> output module and its per-parameter init plan) is the shared one of
``models/common/decoder.py``, which says how it survives parallelism. What is Llama 3's own:
the SwiGLU width rounding (``ModelArgs.hidden_dim``), Llama 3.1's RoPE frequency scaling, and
the ``depth_init`` choice for the output projections' init.
"""

from __future__ import annotations

import torch
from torch import nn

from torchtitan.models.common.decoder import Attention, Decoder, TransformerBlock
from torchtitan.models.common.feed_forward import FeedForward
from torchtitan.models.common.rope import scaled_freqs_cis
from torchtitan.models.llama3.args import ModelArgs


def _block(args: ModelArgs) -> nn.Module:
    attention = Attention(args.dim, args.n_heads, args.kv_heads, args.head_dim)
    return TransformerBlock(
        args.dim, args.norm_eps, attention, FeedForward(args.dim, args.hidden_dim)
    )


class Transformer(Decoder):
    """Llama 3 decoder: embedding, ``n_layers`` blocks, final RMSNorm, output projection (any of
    the three may be ``None`` on a pipeline stage; ``models/common/decoder.py``)."""

    args: ModelArgs

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args, [_block(args) for _ in range(args.n_layers)])

    def _compute_freqs_cis(self, device: torch.device | str | None) -> torch.Tensor:
        a = self.args
        return scaled_freqs_cis(a.head_dim, a.max_seq_len, a.rope_theta, a.rope_scaling, device)

    def _init_depth(self, layer_id: int) -> int:
        # ``depth_init``: scale by the block's own depth, else by the model's (docs/extending.md).
        return layer_id + 1 if self.args.depth_init else self.args.n_layers
