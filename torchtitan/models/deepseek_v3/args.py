"""DeepSeek-V3 model arguments and the named flavors (docs/deepseek_v3.md).

The shared fields, checks and closed-form counts are ``models/common/args.py``'s. DeepSeek-V3
differs from a Llama-style decoder in four places:

* attention is multi-head latent attention (MLA): queries (optionally) and keys/values pass
  through low-rank latents (``q_lora_rank``, ``kv_lora_rank``) with their own RMSNorms; each
  query/key head is a non-rotated part (``qk_nope_head_dim``) plus a rotated part
  (``qk_rope_head_dim``, one rotated key shared by all heads), values are ``v_head_dim`` wide;
* the first ``n_dense_layers`` blocks have a dense SwiGLU, the rest the shared MoE layer
  (sigmoid scores, group-limited routing, shared experts, ``models/common/moe.py``);
* RoPE is YaRN-scaled (``rope_factor``; ``models/common/rope.py``);
* ``mtp_depth`` multi-token-prediction modules predict further tokens, their loss weighted by
  ``mtp_loss_weight`` (``mtp.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import partial

from torchtitan.models.common.args import DEBUG_SHAPE, DecoderArgsBase
from torchtitan.models.common.moe import MoEArgs


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(factor) + 1`` (1.0 when not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


LATENT_NORM_EPS = 1e-6
"""Epsilon of the query/key-value latent RMSNorms (fixed in the published models)."""


@dataclass
class DeepSeekV3Args(DecoderArgsBase):
    """Shape of a DeepSeek-V3 (or V2) decoder. The published shapes are the flavors
    (``DEEPSEEK_V3_FLAVORS``); the defaults here are DeepSeek-V2-Lite's where a flavor is silent."""

    q_lora_rank: int = 0
    """Rank of the query latent; 0: queries are projected directly (``wq``, V2-Lite)."""
    kv_lora_rank: int = 512
    """Rank of the key/value latent (what generation caches per token, with the rotated key)."""
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    """Each query/key head is a non-rotated part and a rotated part (even; one rotated key
    shared by all heads)."""
    v_head_dim: int = 128
    """Width of each value head."""
    attention_bias: bool = False
    """Biases on ``wq_a``, ``wkv_a`` and ``wo`` (HF ``attention_bias``; transformers puts them on
    ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj``, none on ``q_proj``/``q_b_proj``/``kv_b_proj``)."""

    intermediate_size: int = 10944
    """Hidden width of the dense SwiGLU of the first ``n_dense_layers`` blocks."""
    n_dense_layers: int = 1
    """Blocks 0 .. n_dense_layers - 1 are dense (HF ``first_k_dense_replace``), the rest MoE."""
    moe: MoEArgs | None = None
    """The MoE layer of the blocks from ``n_dense_layers`` on; None only when every block is
    dense."""

    rope_factor: float = 1.0
    """YaRN context stretch; 1.0: plain RoPE."""
    rope_original_max_seq_len: int = 4096
    """The context before the stretch (HF ``original_max_position_embeddings``)."""
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    """YaRN's ramp (HF ``beta_fast``, ``beta_slow``): frequencies turning more than
    ``beta_fast`` times over the original context are kept, fewer than ``beta_slow`` are
    stretched by ``rope_factor``, those between blended."""
    rope_mscale: float = 1.0
    rope_mscale_all_dim: float = 0.0
    """YaRN's magnitude corrections (HF ``mscale``, ``mscale_all_dim``): how they scale the
    rotation and the softmax is ``rope_attention_factor`` and ``softmax_scale``."""

    mtp_depth: int = 0
    """Multi-token-prediction modules (each predicts one token further); 0: none."""
    mtp_loss_weight: float = 0.3
    """lambda of the MTP loss ``lambda / D * sum_k CE_k`` (added to the main loss)."""

    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_seq_len: int = 4096

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_kv_heads not in (None, self.n_heads):
            raise ValueError("MLA has one key/value head per query head: n_kv_heads=n_heads")
        if self.qk_rope_head_dim % 2 != 0:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even")
        if self.mtp_depth < 0 or self.mtp_loss_weight < 0:
            raise ValueError("mtp_depth and mtp_loss_weight must be >= 0")
        if self.moe is None and self.n_dense_layers < self.n_layers:
            raise ValueError("blocks from n_dense_layers on are MoE: set moe")

    def with_n_layers(self, n: int) -> DeepSeekV3Args:
        """At depth ``n``: the dense prefix keeps its share of the depth, rounded down, but at
        least one block where the flavor has one and at most ``n - 1``, so at least one MoE
        block remains (671B's 3 of 61 and 16B's 1 of 27 both become 1 of 4; docs/moe.md)."""
        dense = self.n_dense_layers
        if dense and self.moe is not None:
            dense = min(max(1, dense * n // self.n_layers), n - 1)
        return replace(self, n_layers=n, n_dense_layers=dense)

    @property
    def head_dim(self) -> int:
        """Width of one query/key head (non-rotated + rotated part)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def hidden_dim(self) -> int:
        return self.intermediate_size

    @property
    def softmax_scale(self) -> float:
        """``head_dim ** -0.5``, times YaRN's ``mscale(factor, mscale_all_dim) ** 2``."""
        m = yarn_mscale(self.rope_factor, self.rope_mscale_all_dim)
        return self.head_dim**-0.5 * (m * m if self.rope_mscale_all_dim else 1.0)

    @property
    def rope_attention_factor(self) -> float:
        """The magnitude of YaRN's rotation (scales the rotated query and key parts)."""
        if self.rope_mscale and self.rope_mscale_all_dim:
            num = yarn_mscale(self.rope_factor, self.rope_mscale)
            return num / yarn_mscale(self.rope_factor, self.rope_mscale_all_dim)
        return yarn_mscale(self.rope_factor)

    def is_moe_layer(self, layer_id: int) -> bool:
        return self.moe is not None and layer_id >= self.n_dense_layers

    @property
    def n_moe_layers(self) -> int:
        """MoE blocks of the main model (the estimator's count; the MTP blocks are extra)."""
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))

    def _attention_params(self) -> int:
        d, h, qk = self.dim, self.n_heads, self.head_dim
        if self.q_lora_rank:
            q = d * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * h * qk
        else:
            q = d * h * qk
        r = self.kv_lora_rank
        kv = d * (r + self.qk_rope_head_dim) + r + r * h * (self.qk_nope_head_dim + self.v_head_dim)
        biases = (self.q_lora_rank + r + self.qk_rope_head_dim + d) if self.attention_bias else 0
        return q + kv + h * self.v_head_dim * d + biases

    def _ffn_params(self, layer_id: int, active: bool) -> int:
        if self.moe is not None and self.is_moe_layer(layer_id):
            return self.moe.num_params(self.dim, active=active)
        return super()._ffn_params(layer_id, active)

    def mtp_params(self, active: bool = False) -> int:
        """One MTP module: two input norms, the ``2 dim -> dim`` projection, one (MoE) block and
        its final norm (the embedding and the output head are the main model's)."""
        return 3 * self.dim + 2 * self.dim * self.dim + self._layer_params(self.n_layers, active)

    def num_params(self, exclude_embedding: bool = False, active: bool = False) -> int:
        main = super().num_params(exclude_embedding=exclude_embedding, active=active)
        return main + self.mtp_depth * self.mtp_params(active)

    def flops_per_token(self, seq_len: int) -> int:
        """``6 x`` active non-embedding parameters (MTP modules included) ``+`` the attention
        matmuls (``q k^T`` over ``head_dim``, ``p v`` over ``v_head_dim``) of every block and
        MTP block ``+`` the shared output head again for each MTP depth (docs/deepseek_v3.md)."""
        blocks = self.n_layers + self.mtp_depth
        attention = 6 * blocks * self.n_heads * (self.head_dim + self.v_head_dim) * seq_len
        heads = 6 * self.mtp_depth * self.vocab_size * self.dim
        return 6 * self.num_params(exclude_embedding=True, active=True) + attention + heads

    def kv_cache_bytes_per_token(self, bytes_per_value: int = 2) -> int:
        """What generation caches per token and block: the key/value latent and the rotated
        key, not ``2 x n_heads x head_dim`` (docs/deepseek_v3.md)."""
        return (self.kv_lora_rank + self.qk_rope_head_dim) * bytes_per_value * self.n_layers


group_routed_experts = partial(
    MoEArgs, num_shared_experts=1, score_func="sigmoid", bias_update_rate=0.001
)
"""DeepSeek-V3's routing (``MoEArgs`` with these defaults): sigmoid scores, the top-k within the
best ``topk_groups`` of ``n_groups`` groups, one shared expert, routing-bias updates of 0.001."""

DEEPSEEK_V3_FLAVORS: dict[str, DeepSeekV3Args] = {
    "debugmodel": DeepSeekV3Args(
        **DEBUG_SHAPE, n_layers=4, intermediate_size=512, n_dense_layers=1, mtp_depth=1,
        q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        moe=group_routed_experts(num_experts=8, top_k=2, expert_dim=128, n_groups=2,
                                 topk_groups=1, route_scale=1.0, aux_loss_coef=0.001),
        rope_factor=4.0, rope_original_max_seq_len=512, rope_mscale=1.0, rope_mscale_all_dim=1.0,
    ),
    # DeepSeek-V2-Lite's published shape (deepseek-ai/DeepSeek-V2-Lite config.json): 15.7B.
    "16B": DeepSeekV3Args(
        dim=2048, n_layers=27, n_heads=16, vocab_size=102400, max_seq_len=163840,
        moe=MoEArgs(num_experts=64, top_k=6, expert_dim=1408, num_shared_experts=2,
                    score_func="softmax", route_norm=False, aux_loss_coef=0.001),
        rope_factor=40.0, rope_mscale=0.707, rope_mscale_all_dim=0.707,
    ),
    # DeepSeek-V3's published shape (deepseek-ai/DeepSeek-V3 config.json): 671B + the MTP module.
    "671B": DeepSeekV3Args(
        dim=7168, n_layers=61, n_heads=128, vocab_size=129280, max_seq_len=163840,
        q_lora_rank=1536, intermediate_size=18432, n_dense_layers=3, mtp_depth=1,
        # 256 routed experts, top-8 in at most 4 of 8 groups
        moe=group_routed_experts(num_experts=256, top_k=8, expert_dim=2048, n_groups=8,
                                 topk_groups=4, route_scale=2.5, aux_loss_coef=0.0001),
        rope_factor=40.0, rope_mscale=1.0, rope_mscale_all_dim=1.0,
    ),
}  # fmt: skip
"""The named shapes. The trainer replaces ``vocab_size`` (tokenizer) and ``max_seq_len``
(``training.seq_len``)."""

__all__ = ["DEEPSEEK_V3_FLAVORS", "DeepSeekV3Args", "MoEArgs", "group_routed_experts"]
