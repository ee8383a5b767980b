"""Qwen3 / Qwen3-MoE weights: our names and layouts <-> Hugging Face ``Qwen3ForCausalLM`` and
``Qwen3MoeForCausalLM``.

- names: ``layers.3.attention.q_norm.weight`` <-> ``model.layers.3.self_attn.q_norm.weight``...;
- RoPE channel order (as in ``llama3/state_dict_adapter.py``): ``wq``/``wk`` rows are permuted
  within each head, and so are the QK-norm weights (the norm runs on the same channels before
  RoPE; RMSNorm does not care about channel order, only its weight does);
- experts: ours are stacked ``w1``/``w3`` ``[E, dim, hidden]`` and ``w2`` ``[E, hidden, dim]``;
  Hugging Face checkpoints hold one ``nn.Linear`` per expert
  (``mlp.experts.<e>.gate_proj.weight [hidden, dim]``...), which is what ``to_hf`` writes.
  ``from_hf`` also reads the fused layout transformers 5 keeps in memory
  (``mlp.experts.gate_up_proj [E, 2 * hidden, dim]``, ``mlp.experts.down_proj``).
- the router: ``feed_forward.router.gate.weight`` <-> ``mlp.gate.weight``. The
  auxiliary-loss-free bias has no Hugging Face counterpart: it must be zero to export.

Exact (permutations, transposes, renames), so HF -> ours -> HF is bit-identical.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from torchtitan.models.common.moe import MoEArgs
from torchtitan.models.llama3.state_dict_adapter import _to_half_split, _to_interleaved
from torchtitan.models.qwen3.args import Qwen3Args

_LAYER_KEYS = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.router.gate.weight": "mlp.gate.weight",
}
_TOP_KEYS = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_EXPERT_KEYS = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_HF_LAYER_KEYS = {v: k for k, v in _LAYER_KEYS.items()}
_HF_TOP_KEYS = {v: k for k, v in _TOP_KEYS.items()}
_OURS_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_HF_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class Qwen3StateDictAdapter:
    """Converts full (unsharded) Qwen3 state dicts between our format and Hugging Face's."""

    def __init__(self, args: Qwen3Args) -> None:
        self.args = args

    def _permute(self, ours: str, w: torch.Tensor, to_hf: bool) -> torch.Tensor:
        a = self.args
        heads = {"attention.wq.weight": a.n_heads, "attention.wk.weight": a.n_kv_heads}
        norm = ours in ("attention.q_norm.weight", "attention.k_norm.weight")
        if ours not in heads and not norm:
            return w
        fn = _to_half_split if to_hf else _to_interleaved
        if norm:  # one head's channels, as a column
            return fn(w[:, None], 1)[:, 0]
        return fn(w, heads[ours])

    def to_hf(self, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for key, w in sd.items():
            if key in _TOP_KEYS:
                if key == "output.weight" and self.args.tie_word_embeddings:
                    continue
                out[_TOP_KEYS[key]] = w
                continue
            m = _OURS_LAYER.match(key)
            if m is None:
                raise KeyError(f"no Hugging Face name for {key!r}")
            layer, name = m.group(1), m.group(2)
            prefix = f"model.layers.{layer}."
            if name == "feed_forward.router.expert_bias":
                if bool(w.any()):
                    raise ValueError(
                        f"{key} is non-zero (auxiliary-loss-free balancing): Hugging Face's "
                        "Qwen3-MoE has no routing bias, the exported model would route differently"
                    )
                continue
            if name.startswith("feed_forward.experts."):
                hf_name = _EXPERT_KEYS[name.rsplit(".", 1)[1]]
                for e in range(w.shape[0]):
                    out[f"{prefix}mlp.experts.{e}.{hf_name}.weight"] = w[e].t().contiguous()
                continue
            if name not in _LAYER_KEYS:
                raise KeyError(f"no Hugging Face name for {key!r} (shared experts have none)")
            out[prefix + _LAYER_KEYS[name]] = self._permute(name, w, to_hf=True).contiguous()
        return out

    def from_hf(self, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
        for key, w in hf.items():
            if key in _HF_TOP_KEYS:
                out[_HF_TOP_KEYS[key]] = w
                continue
            m = _HF_LAYER.match(key)
            if m is None:
                if key.endswith("rotary_emb.inv_freq"):
                    continue
                raise KeyError(f"unexpected Hugging Face key {key!r}")
            layer, name = m.group(1), m.group(2)
            prefix = f"layers.{layer}.feed_forward."
            if (e := _HF_EXPERT.match(name)) is not None:
                ours = {v: k for k, v in _EXPERT_KEYS.items()}[e.group(2)]
                experts.setdefault((layer, ours), {})[int(e.group(1))] = w.t()
            elif name == "mlp.experts.gate_up_proj":  # transformers 5 fused layout
                gate, up = w.chunk(2, dim=1)
                out[prefix + "experts.w1"] = gate.transpose(1, 2).contiguous()
                out[prefix + "experts.w3"] = up.transpose(1, 2).contiguous()
            elif name == "mlp.experts.down_proj":
                out[prefix + "experts.w2"] = w.transpose(1, 2).contiguous()
            elif name in _HF_LAYER_KEYS:
                ours = _HF_LAYER_KEYS[name]
                out[f"layers.{layer}.{ours}"] = self._permute(ours, w, to_hf=False).contiguous()
            else:
                raise KeyError(f"unexpected Hugging Face key {key!r}")
        for (layer, ours), by_id in experts.items():
            out[f"layers.{layer}.feed_forward.experts.{ours}"] = torch.stack(
                [by_id[i] for i in range(len(by_id))]
            ).contiguous()
        for key in list(out):
            if key.endswith("router.gate.weight"):
                gate = out[key]
                out[key.replace("gate.weight", "expert_bias")] = gate.new_zeros(gate.shape[0])
        if self.args.tie_word_embeddings and "output.weight" not in out:
            out["output.weight"] = out["tok_embeddings.weight"]
        return out

    def hf_config(self, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """``config.json`` for transformers' ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM``."""
        a = self.args
        config: dict[str, Any] = {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "vocab_size": a.vocab_size,
            "hidden_size": a.dim,
            "intermediate_size": a.intermediate_size,
            "num_hidden_layers": a.n_layers,
            "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.n_kv_heads,
            "head_dim": a.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": a.norm_eps,
            "rope_theta": a.rope_theta,
            "max_position_embeddings": a.max_seq_len,
            "tie_word_embeddings": a.tie_word_embeddings,
            "attention_bias": False,
            "torch_dtype": str(dtype).removeprefix("torch."),
        }
        if a.moe is not None:
            m = a.moe
            if m.num_shared_experts or m.score_func != "softmax" or m.n_groups > 1:
                raise ValueError("Qwen3-MoE has no shared experts, sigmoid or grouped routing")
            sparse = [i for i in range(a.n_layers) if a.is_moe_layer(i)]
            config.update(
                architectures=["Qwen3MoeForCausalLM"],
                model_type="qwen3_moe",
                num_experts=m.num_experts,
                num_experts_per_tok=m.top_k,
                moe_intermediate_size=m.expert_dim,
                norm_topk_prob=m.route_norm,
                decoder_sparse_step=1,
                mlp_only_layers=[i for i in range(a.n_layers) if i not in sparse],
                router_aux_loss_coef=m.aux_loss_coef,
            )
        return config


def args_from_hf_config(config: dict[str, Any]) -> Qwen3Args:
    """Our args for a Hugging Face Qwen3 or Qwen3-MoE ``config.json``."""
    rope = config.get("rope_parameters") or {}
    n_layers = config["num_hidden_layers"]
    moe = None
    moe_layers = None
    if config.get("model_type") == "qwen3_moe":
        moe = MoEArgs(
            # transformers >= 5 writes num_local_experts
            num_experts=int(config.get("num_experts") or config["num_local_experts"]),
            top_k=config["num_experts_per_tok"],
            expert_dim=config["moe_intermediate_size"],
            route_norm=config.get("norm_topk_prob", True),
        )
        step, dense = config.get("decoder_sparse_step", 1), config.get("mlp_only_layers", [])
        sparse = [i for i in range(n_layers) if i not in dense and (i + 1) % step == 0]
        moe_layers = None if len(sparse) == n_layers else tuple(sparse)
    return Qwen3Args(
        dim=config["hidden_size"],
        n_layers=n_layers,
        n_heads=config["num_attention_heads"],
        n_kv_heads=config.get("num_key_value_heads", config["num_attention_heads"]),
        head_dim=config.get("head_dim", config["hidden_size"] // config["num_attention_heads"]),
        intermediate_size=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=config.get("rope_theta", rope.get("rope_theta", 1000000.0)),
        max_seq_len=config.get("max_position_embeddings", 40960),
        tie_word_embeddings=config.get("tie_word_embeddings", False),
        moe=moe,
        moe_layers=moe_layers,
    )
