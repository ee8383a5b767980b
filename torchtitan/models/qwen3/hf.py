"""Qwen3's Hugging Face format (``Qwen3ForCausalLM``, ``Qwen3MoeForCausalLM``), declared for the
shared adapter (``models/common/hf/``; docs/extending.md, section 5; docs/moe.md):

- the Llama-style names plus the QK-norms (``self_attn.q_norm``...), whose weights are permuted
  like the ``wq``/``wk`` rows (the norm runs on the same channels before RoPE);
- experts: ours stacked ``w1``/``w3`` ``[E, dim, hidden]``, ``w2`` ``[E, hidden, dim]``; HF
  checkpoints one ``nn.Linear`` per expert (``mlp.experts.<e>.gate_proj.weight``), and the
  fused layout transformers 5 keeps in memory (``mlp.experts.gate_up_proj [E, 2 * hidden,
  dim]``, ``mlp.experts.down_proj``) is read too;
- the router ``feed_forward.router.gate`` <-> ``mlp.gate``; the auxiliary-loss-free bias has no
  HF counterpart: it must be zero to export;
- ``config.json``: the MoE fields (``mlp_only_layers``, ``decoder_sparse_step``...), RoPE
  scaling (``models/common/hf/rope.py``), the sliding window; every key checked (``hf_keys.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torchtitan.models.common.hf import ConfigField, ExpertStack, HFConfig, HFMapping, OursOnly
from torchtitan.models.common.hf.decoder import (
    ATTENTION,
    BLOCK_NORMS,
    DECODER_TOP,
    QK_NORM,
    ROPE_QK,
    ROPE_QK_NORM,
    SWIGLU,
    decoder_constants,
    decoder_fields,
    heads_of,
)
from torchtitan.models.common.hf.rope import RopeSection
from torchtitan.models.common.moe import MoEArgs
from torchtitan.models.qwen3.args import Qwen3Args
from torchtitan.models.qwen3.hf_keys import QWEN3_KEYS, window_from_hf, window_to_hf


class _MoESection:
    """``Qwen3MoeForCausalLM``'s fields <-> ``moe`` and ``moe_layers``."""

    def to_hf(self, a: Qwen3Args) -> dict[str, Any]:
        m = a.moe
        if m is None:
            return {}
        if m.num_shared_experts or m.score_func != "softmax" or m.n_groups > 1:
            raise ValueError("Qwen3-MoE has no shared experts, sigmoid or grouped routing")
        return {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "num_experts": m.num_experts,
            "num_experts_per_tok": m.top_k,
            "moe_intermediate_size": m.expert_dim,
            "norm_topk_prob": m.route_norm,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i in range(a.n_layers) if not a.is_moe_layer(i)],
        }

    def from_hf(self, config: Mapping[str, Any]) -> dict[str, Any]:
        if config.get("model_type") != "qwen3_moe":
            return {}
        moe = MoEArgs(
            # transformers >= 5 writes num_local_experts
            num_experts=int(config.get("num_experts") or config["num_local_experts"]),
            top_k=config["num_experts_per_tok"],
            expert_dim=config["moe_intermediate_size"],
            route_norm=config.get("norm_topk_prob", False),  # transformers' default
            # Not router_aux_loss_coef: it weights transformers' pooled balancing loss, not
            # ours (hf_keys.py); an imported model keeps MoEArgs' default, docs/moe.md.
        )
        n_layers = config["num_hidden_layers"]
        step, dense = config.get("decoder_sparse_step", 1), config.get("mlp_only_layers", [])
        sparse = [i for i in range(n_layers) if i not in dense and (i + 1) % step == 0]
        return {"moe": moe, "moe_layers": None if len(sparse) == n_layers else tuple(sparse)}


class _WindowSection:
    """``use_sliding_window``, ``sliding_window``, ``max_window_layers``, ``layer_types`` <->
    ``sliding_window`` and ``window_layers`` (``hf_keys.py``)."""

    def to_hf(self, a: Qwen3Args) -> dict[str, Any]:
        return window_to_hf(a)

    def from_hf(self, config: Mapping[str, Any]) -> dict[str, Any]:
        return window_from_hf(config)


def _head_dim(config: Mapping[str, Any]) -> int:
    return int(config["hidden_size"] // config["num_attention_heads"])


_CONFIG = HFConfig(
    make_args=Qwen3Args,
    constants=decoder_constants("Qwen3ForCausalLM", "qwen3"),
    fields=(
        *decoder_fields(kv_heads=heads_of, norm_eps=1e-6, rope_theta=1e6, max_seq_len=40960),
        ConfigField("head_dim", "head_dim", default=_head_dim),
        ConfigField("intermediate_size", "intermediate_size"),
    ),
    sections=(_MoESection(), RopeSection(), _WindowSection()),
    keys=QWEN3_KEYS,
)

_NO_BIAS = (
    "auxiliary-loss-free balancing; Hugging Face's Qwen3-MoE has no routing bias, the exported "
    "model would route differently"
)
QWEN3_HF = HFMapping(
    top=DECODER_TOP,
    layer={
        **ATTENTION,
        **QK_NORM,
        **BLOCK_NORMS,
        **SWIGLU,
        "feed_forward.router.gate.weight": "mlp.gate.weight",
    },
    transforms={**ROPE_QK, **ROPE_QK_NORM},
    experts=ExpertStack(fused={"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}),
    ours_only={
        "feed_forward.router.expert_bias": OursOnly("feed_forward.router.gate.weight", _NO_BIAS)
    },
    config=_CONFIG,
    unmapped_hint=" (shared experts have none)",
)
"""Qwen3 / Qwen3-MoE <-> ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM``."""


def args_from_hf_config(config: Mapping[str, Any]) -> Qwen3Args:
    """Our args for a Hugging Face Qwen3 or Qwen3-MoE ``config.json``."""
    args: Qwen3Args = QWEN3_HF.config.args_from_hf(config)
    return args
