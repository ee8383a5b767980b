"""The GPT-OSS transformer as a plain ``nn.Module`` (architecture only; docs/gpt_oss.md).

The decoder skeleton is the shared one of ``models/common/decoder.py`` (blocks in an
``nn.ModuleDict``, ``None`` roots on pipeline stages, heads derived from tensor shapes, a
swappable attention core, a per-parameter init plan). GPT-OSS's own parts: attention with biases,
sinks and (every other block) a sliding window (``attention.py``), the YaRN RoPE table
(``models/common/rope.py``) and the biased, clamped MoE of every block (``moe.py``).

RoPE rotates adjacent channel pairs here; Hugging Face's GPT-OSS rotates the two halves of a
head. ``hf.py`` permutes the ``wq``/``wk`` rows and biases between the two layouts.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from torchtitan.models.common.decoder import BLOCK_INIT, Decoder, TransformerBlock
from torchtitan.models.common.rope import precompute_freqs_cis, precompute_yarn_freqs_cis
from torchtitan.models.gpt_oss.args import GptOssArgs
from torchtitan.models.gpt_oss.attention import GptOssAttention
from torchtitan.models.gpt_oss.moe import GptOssMoE

# Init kinds of GPT-OSS's own parameters ("zero": biases; sinks start at 0, i.e. a sink as
# strong as one key scoring 0).
GPT_OSS_INIT: Mapping[str, str] = {
    **BLOCK_INIT,
    **{f"attention.{p}.bias": "zero" for p in ("wq", "wk", "wv", "wo")},
    "attention.core.sinks": "zero",
    "feed_forward.router.gate.bias": "zero",
    "feed_forward.experts.gate_up_proj": "in",
    "feed_forward.experts.gate_up_proj_bias": "zero",
    "feed_forward.experts.down_proj": "out",
    "feed_forward.experts.down_proj_bias": "zero",
}


def _block(layer_id: int, args: GptOssArgs) -> nn.Module:
    attention = GptOssAttention(args, layer_id)
    moe = GptOssMoE(args.dim, args.moe, args.swiglu_limit, args.swiglu_alpha)
    return TransformerBlock(args.dim, args.norm_eps, attention, moe)


class Transformer(Decoder):
    """GPT-OSS decoder: embedding, ``n_layers`` blocks, final RMSNorm, output projection (any of
    the three may be ``None`` on a pipeline stage; ``models/common/decoder.py``)."""

    args: GptOssArgs
    block_init = GPT_OSS_INIT

    def __init__(self, args: GptOssArgs) -> None:
        super().__init__(args, [_block(i, args) for i in range(args.n_layers)])

    def _compute_freqs_cis(self, device: torch.device | str | None) -> torch.Tensor:
        a = self.args
        if a.yarn is None:
            return precompute_freqs_cis(a.head_dim, a.max_seq_len, a.rope_theta, device=device)
        return precompute_yarn_freqs_cis(a.head_dim, a.max_seq_len, a.rope_theta, a.yarn, device)
