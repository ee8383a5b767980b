"""The DeepSeek-V3 transformer as a plain ``nn.Module`` (architecture only; docs/deepseek_v3.md).

The decoder skeleton is the shared one (``models/common/decoder.py``: blocks in an
``nn.ModuleDict``, ``None`` roots on pipeline stages, a per-parameter init plan). What is
DeepSeek-V3's own: multi-head latent attention (``mla.py``), dense SwiGLU blocks first then MoE
blocks, the YaRN RoPE table of the rotated head part, and the multi-token-prediction modules
(``mtp.py``) under ``mtp``.

A block's feed-forward is ``feed_forward`` (the dense SwiGLU) or ``moe`` (the shared MoE
layer), the other one ``None``: one tensor-parallel block plan then holds both kinds, each style
applying where its module exists (``parallel_plan.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.distributed.init_weights import ParamInit
from torchtitan.models.common.attention import OptMask
from torchtitan.models.common.decoder import BLOCK_INIT, Decoder, FeedForward, TransformerBlock
from torchtitan.models.common.kv_cache import KVCache
from torchtitan.models.common.moe import MoE, _AttachAuxLoss
from torchtitan.models.common.rope import (
    YarnScaling,
    precompute_freqs_cis,
    precompute_yarn_freqs_cis,
)
from torchtitan.models.deepseek_v3.args import DeepSeekV3Args
from torchtitan.models.deepseek_v3.mla import MLA
from torchtitan.models.deepseek_v3.mtp import MTPMetrics, MTPModule, mtp_loss


class Block(TransformerBlock):
    """Pre-norm block: ``h = x + mla(norm(x)); out = h + ffn(norm(h))``, the feed-forward a
    SwiGLU (``feed_forward``, the first ``n_dense_layers`` blocks) or the MoE layer (``moe``)."""

    def __init__(self, layer_id: int, a: DeepSeekV3Args) -> None:
        is_moe = a.moe is not None and a.is_moe_layer(layer_id)
        dense = None if is_moe else FeedForward(a.dim, a.intermediate_size)
        super().__init__(a.dim, a.norm_eps, MLA(a), dense)
        self.moe: MoE | None = MoE(a.dim, a.moe) if a.moe is not None and is_moe else None

    def ffn(self) -> nn.Module:
        return self.moe if self.moe is not None else super().ffn()


_MLA_INIT = {
    "attention.wq.weight": "in",
    "attention.wq_a.weight": "in",
    "attention.wq_b.weight": "in",
    "attention.q_norm.weight": "one",
    "attention.wkv_a.weight": "in",
    "attention.wkv_b.weight": "in",
    "attention.kv_norm.weight": "one",
}
BLOCK_INIT_V3: Mapping[str, str] = {
    **BLOCK_INIT,
    **_MLA_INIT,
    **{
        "moe." + k.removeprefix("feed_forward."): v
        for k, v in BLOCK_INIT.items()
        if k.startswith(("feed_forward.router", "feed_forward.experts", "feed_forward.shared"))
    },
}
"""The shared block init table, MLA's projections and norms, the MoE layer under ``moe``."""


def _mtp_block_args(a: DeepSeekV3Args) -> DeepSeekV3Args:
    """The MTP blocks' args: their MoE balancing loss is part of the MTP objective, weighted by
    ``mtp_loss_weight / mtp_depth`` like the MTP cross-entropies (weight 0: the main model
    trains exactly as without MTP)."""
    if a.moe is None:
        return a
    coef = a.moe.aux_loss_coef * a.mtp_loss_weight / a.mtp_depth
    return replace(a, moe=replace(a.moe, aux_loss_coef=coef))


class Transformer(Decoder):
    """DeepSeek-V3 decoder: embedding, ``n_layers`` blocks, final RMSNorm, output projection,
    and ``mtp_depth`` MTP modules (any root may be ``None`` on a pipeline stage)."""

    args: DeepSeekV3Args
    block_init = BLOCK_INIT_V3
    mtp_since_log: torch.Tensor

    def __init__(self, args: DeepSeekV3Args) -> None:
        super().__init__(args, [Block(i, args) for i in range(args.n_layers)])
        self.mtp: nn.ModuleDict | None = None
        if args.mtp_depth > 0:
            mtp_args = _mtp_block_args(args)
            self.mtp = nn.ModuleDict(
                {
                    str(k): MTPModule(args, Block(args.n_layers + k, mtp_args))
                    for k in range(args.mtp_depth)
                }
            )
        self.aux_loss_scale = 1.0
        """Gradient seed of the MTP loss: the main loss's per-forward factor (set with the
        MoE layers' by ``set_aux_loss_scale``)."""
        self.mtp_loss: torch.Tensor | None = None
        """The last training forward's MTP loss (detached, unweighted mean over the depths)."""
        self.register_buffer("mtp_since_log", torch.zeros(2), persistent=False)  # sum, count

    def _compute_freqs_cis(self, device: torch.device | str | None) -> torch.Tensor:
        a = self.args
        if a.rope_factor == 1.0:
            return precompute_freqs_cis(
                a.qk_rope_head_dim, a.max_seq_len, theta=a.rope_theta, device=device
            )
        yarn = YarnScaling(
            factor=a.rope_factor,
            original_max_seq_len=a.rope_original_max_seq_len,
            beta_fast=a.rope_beta_fast,
            beta_slow=a.rope_beta_slow,
            attention_factor=a.rope_attention_factor,
        )
        return precompute_yarn_freqs_cis(
            a.qk_rope_head_dim, a.max_seq_len, a.rope_theta, yarn, device=device
        )

    def enable_context_parallel(self, mesh: object) -> None:
        """Called by context parallel (``distributed/context_parallel.py``): the MTP modules
        read tokens ``k`` positions ahead, which another rank holds under CP."""
        if self.mtp is not None:
            raise ValueError(
                "multi-token prediction under context parallel is not built: "
                "set --model.mtp_depth 0 (docs/deepseek_v3.md)"
            )

    def _head(
        self, h: Tensor, tokens: Tensor, freqs_cis: Tensor, mask: OptMask, cache: KVCache | None
    ) -> Tensor:
        """The shared head; in a training forward (gradients on, no cache) with MTP modules,
        their loss joins the backward through the returned logits (like the MoE auxiliary loss,
        ``models/common/moe.py``) and is kept for the metrics."""
        hidden = h
        logits = super()._head(h, tokens, freqs_cis, mask, cache)
        if self.output is None:
            return logits
        self.mtp_loss = None
        if self.mtp is None or cache is not None or not torch.is_grad_enabled():
            return logits
        if self.tok_embeddings is None:
            raise ValueError(
                "multi-token prediction needs the embedding on the last pipeline stage, which "
                "is not built: set --model.mtp_depth 0 (docs/deepseek_v3.md)"
            )
        loss, mean = mtp_loss(
            self.mtp,
            self.tok_embeddings,
            self.output,
            hidden,
            tokens,
            freqs_cis,
            mask,
            self.args.mtp_loss_weight,
        )
        self.mtp_loss = mean.detach()
        if self.training and not torch.compiler.is_compiling():
            with torch.no_grad():
                self.mtp_since_log += torch.stack([self.mtp_loss, torch.ones_like(self.mtp_loss)])
        return _AttachAuxLoss.apply(logits, loss, self.aux_loss_scale)

    def metrics_sources(self, mesh: DeviceMesh | None) -> list[MTPMetrics]:
        """The trainer's extra metrics of this model part: the MTP loss, where it has MTP."""
        return [MTPMetrics(self, mesh)] if self.mtp is not None else []

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """The shared buffers (RoPE table, MoE counters) and the MTP sums to zero."""
        super().init_buffers(device)
        self.mtp_since_log.zero_()

    def _rule(self, fqn: str) -> ParamInit:
        if not fqn.startswith("mtp."):
            return super()._rule(fqn)
        _, depth, rest = fqn.split(".", 2)
        if rest.startswith("block."):  # the MTP block: the block rules at depth n_layers + k
            kind = self.block_init[rest.removeprefix("block.")]
            if kind == "out":
                layer = self.args.n_layers + int(depth) + 1
                return ParamInit("trunc_normal", std=0.02 / math.sqrt(2 * layer))
            return ParamInit("ones") if kind == "one" else ParamInit("trunc_normal", std=0.02)
        if rest == "eh_proj.weight":
            return ParamInit("trunc_normal", std=0.02)
        return ParamInit("ones")  # enorm, hnorm, norm
