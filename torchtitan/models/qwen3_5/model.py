"""The Qwen3.5 text decoder (dense and MoE) as a plain ``nn.Module`` (architecture only).

The skeleton is ``models/common/decoder.py``'s :class:`Decoder` (blocks in an
``nn.ModuleDict``, ``None`` roots on pipeline stages, the per-parameter init plan); the blocks
and norms are Qwen3.5's (``layers.py``). The RoPE table covers only the rotated channels of a
head (``partial_rotary_factor``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from torchtitan.distributed.init_weights import ParamInit
from torchtitan.models.common.decoder import BLOCK_INIT, Decoder
from torchtitan.models.common.rope import precompute_freqs_cis
from torchtitan.models.qwen3_5.args import Qwen35Args
from torchtitan.models.qwen3_5.layers import Qwen35Block, ZeroCenteredRMSNorm

QWEN35_INIT: Mapping[str, str] = {
    **BLOCK_INIT,
    "attention.q_norm.weight": "zero",  # zero-centred: (1 + w) starts at 1
    "attention.k_norm.weight": "zero",
    "attention_norm.weight": "zero",
    "ffn_norm.weight": "zero",
    "linear_attn.wqkv.weight": "in",
    "linear_attn.wz.weight": "in",
    "linear_attn.wb.weight": "in",
    "linear_attn.wa.weight": "in",
    "linear_attn.wo.weight": "out",
    "linear_attn.A_log": "zero",  # A = 1
    "linear_attn.dt_bias": "one",
    "linear_attn.norm.weight": "one",
    "feed_forward.shared_expert.w1.weight": "in",
    "feed_forward.shared_expert.w3.weight": "out",
    "feed_forward.shared_expert.w2.weight": "out",
    "feed_forward.shared_gate.weight": "in",
}


class Qwen35Transformer(Decoder):
    """Qwen3.5 decoder: embedding, ``n_layers`` hybrid blocks, final zero-centred RMSNorm,
    output projection (any of the three may be ``None`` on a pipeline stage)."""

    args: Qwen35Args
    block_init = QWEN35_INIT

    def __init__(self, args: Qwen35Args) -> None:
        super().__init__(args, [Qwen35Block(i, args) for i in range(args.n_layers)])
        self.norm = ZeroCenteredRMSNorm(args.dim, args.norm_eps)  # type: ignore[assignment]

    def _compute_freqs_cis(self, device: torch.device | str | None) -> torch.Tensor:
        a = self.args
        return precompute_freqs_cis(a.rotary_dim, a.max_seq_len, theta=a.rope_theta, device=device)

    def _rule(self, fqn: str) -> ParamInit:
        if fqn == "norm.weight":
            return ParamInit("zeros")
        if fqn.endswith(".linear_attn.conv"):
            return ParamInit("trunc_normal", std=self.args.linear_conv_kernel_dim**-0.5)
        return super()._rule(fqn)
