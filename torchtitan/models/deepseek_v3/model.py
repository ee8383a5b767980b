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

from torchtitan.distributed.context_parallel import AllGatherKVAttention
from torchtitan.distributed.init_weights import ParamInit
from torchtitan.models.common.attention import OptMask
from torchtitan.models.common.decoder import BLOCK_INIT, Decoder, TransformerBlock
from torchtitan.models.common.feed_forward import FeedForward
from torchtitan.models.common.kv_cache import KVCache
from torchtitan.models.common.moe import MoE, _AttachAuxLoss
from torchtitan.models.common.rope import (
    YarnScaling,
    precompute_freqs_cis,
    precompute_yarn_freqs_cis,
)
from torchtitan.models.deepseek_v3.args import DeepSeekV3Args
from torchtitan.models.deepseek_v3.mla import MLA
from torchtitan.models.deepseek_v3.mtp import (
    MTPModule,
    mtp_embeddings,
    mtp_loss,
    mtp_tokens,
)


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
    "attention.wq_a.bias": "zero",  # attention_bias
    "attention.wkv_a.bias": "zero",
    "attention.wo.bias": "zero",
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
        self.cp_mesh: DeviceMesh | None = None
        """The context-parallel mesh (``enable_context_parallel``), or None."""

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

    def enable_context_parallel(self, mesh: DeviceMesh) -> None:
        """Called by context parallel (``distributed/context_parallel/core.py``, ``allgather``): the
        MTP blocks attend over the whole sequence like the main blocks (their attention core
        gathers K/V over ``cp``), and their loss is normalised by the whole sequences' targets.
        Their shifted tokens come in ``mtp_tokens``, made before the sequence was sharded."""
        self.cp_mesh = mesh
        for module in self.mtp.values() if self.mtp is not None else ():
            module.get_submodule("block.attention").core = AllGatherKVAttention(mesh, 1)

    def batch_inputs(self, tokens: Tensor) -> dict[str, Tensor]:
        """Keyword inputs the trainer adds to every batch (``microbatch.py``), before context
        parallel shards the sequence and given to every pipeline stage: with MTP, each module's
        input and target tokens (``mtp.mtp_tokens``)."""
        if self.args.mtp_depth == 0:
            return {}
        return {"mtp_tokens": mtp_tokens(tokens, self.args.mtp_depth)}

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor | None = None,
        cache: KVCache | None = None,
        doc_ids: Tensor | None = None,
        mtp_tokens: Tensor | None = None,
    ) -> Tensor:
        """The shared decoder's forward (``models/common/decoder.py``), plus ``mtp_tokens``
        (``batch_inputs``). Under pipeline parallel with MTP the first stage embeds the MTP
        modules' input tokens with the embedding only it holds and sends them to the last stage
        behind the hidden states (``[B, S, (1 + D) dim]``: ``h`` then one ``dim`` slice per
        depth; the stages between pass them on); their gradient returns the same way to the
        embedding (docs/deepseek_v3.md, "Multi-token prediction under pipeline parallel")."""
        carry = self.args.mtp_depth > 0 and mtp_tokens is not None and cache is None
        carried: Tensor | None = None
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(tokens)
        elif carry:
            dim = self.args.dim
            h, carried = tokens.split([dim, tokens.shape[-1] - dim], dim=-1)
        else:
            h = tokens
        h, freqs_cis, mask = self.run_blocks(h, positions, doc_ids, cache)
        if self.output is None:  # a pipeline stage before the last
            if not carry:
                return h
            assert mtp_tokens is not None
            if carried is None:
                assert self.tok_embeddings is not None
                carried = torch.cat(mtp_embeddings(self.tok_embeddings, mtp_tokens), dim=-1)
            return torch.cat([h, carried], dim=-1)
        logits = super()._head(h, tokens, freqs_cis, mask, cache)
        if self.mtp is None or cache is not None or not torch.is_grad_enabled():
            self.mtp_loss = None
            return logits
        return self._with_mtp_loss(logits, h, tokens, mtp_tokens, carried, freqs_cis, mask)

    def _with_mtp_loss(
        self,
        logits: Tensor,
        hidden: Tensor,
        tokens: Tensor,
        shifted_tokens: Tensor | None,
        carried: Tensor | None,
        freqs_cis: Tensor,
        mask: OptMask,
    ) -> Tensor:
        """``logits``, through which the MTP loss joins the backward (like the MoE auxiliary
        loss, ``models/common/moe.py``); the loss is kept for the metrics."""
        assert self.mtp is not None and self.output is not None
        if shifted_tokens is None:
            if self.tok_embeddings is None or self.cp_mesh is not None:
                raise ValueError(
                    "multi-token prediction on a pipeline stage or under context parallel needs "
                    "the batch's mtp_tokens (Transformer.batch_inputs; the trainer adds them)"
                )
            shifted_tokens = mtp_tokens(tokens, self.args.mtp_depth)
        if carried is not None:
            embeddings = list(carried.chunk(self.args.mtp_depth, dim=-1))
        else:
            assert self.tok_embeddings is not None
            embeddings = mtp_embeddings(self.tok_embeddings, shifted_tokens)
        loss, mean = mtp_loss(
            self.mtp,
            self.output,
            hidden,
            embeddings,
            shifted_tokens,
            freqs_cis,
            mask,
            self.args.mtp_loss_weight,
            self.cp_mesh,
        )
        self.mtp_loss = mean.detach()
        if self.training and not torch.compiler.is_compiling():
            with torch.no_grad():
                self.mtp_since_log += torch.stack([self.mtp_loss, torch.ones_like(self.mtp_loss)])
        return _AttachAuxLoss.apply(logits, loss, self.aux_loss_scale)

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
            if kind in ("one", "zero"):
                return ParamInit("ones" if kind == "one" else "zeros")
            return ParamInit("trunc_normal", std=0.02)
        if rest == "eh_proj.weight":
            return ParamInit("trunc_normal", std=0.02)
        return ParamInit("ones")  # enorm, hnorm, norm
