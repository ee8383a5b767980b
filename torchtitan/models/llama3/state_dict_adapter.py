"""Llama 3 weights: our names and RoPE layout <-> Hugging Face ``LlamaForCausalLM``.

Two differences only:

- names: ``layers.3.attention.wq.weight`` <-> ``model.layers.3.self_attn.q_proj.weight`` etc.;
- RoPE channel order: our ``apply_rotary_emb`` rotates adjacent channel pairs ``(2i, 2i+1)`` of
  each head (complex multiplication), Hugging Face's ``rotate_half`` rotates ``(i, i + Dh/2)``.
  The attention scores are the same when the rows of ``wq`` and ``wk`` are permuted within each
  head: ours -> HF takes the even rows then the odd rows; HF -> ours interleaves them back.
  ``wv``/``wo`` are unchanged (the permutation of q and k cancels in ``q . k``).

The conversion is exact (a permutation and renaming, no arithmetic), so HF -> ours -> HF is
bit-identical. Works on plain tensors (full weights); use it after gathering a checkpoint.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from torchtitan.models.llama3.args import ModelArgs

# our per-layer name -> HF per-layer name (inside ``model.layers.<i>.``)
_LAYER_KEYS = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_KEYS = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_HF_LAYER_KEYS = {v: k for k, v in _LAYER_KEYS.items()}
_HF_TOP_KEYS = {v: k for k, v in _TOP_KEYS.items()}
_OURS_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _to_half_split(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of each head from interleaved pairs (ours) to the two-halves order (HF)."""
    rows, cols = w.shape
    head_dim = rows // n_heads
    return w.view(n_heads, head_dim // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def _to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of :func:`_to_half_split`."""
    rows, cols = w.shape
    head_dim = rows // n_heads
    return w.view(n_heads, 2, head_dim // 2, cols).transpose(1, 2).reshape(rows, cols)


class Llama3StateDictAdapter:
    """Converts full (unsharded) Llama 3 state dicts between our format and Hugging Face's."""

    def __init__(self, args: ModelArgs) -> None:
        self.args = args

    def to_hf(self, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        a = self.args
        out: dict[str, torch.Tensor] = {}
        for key, w in sd.items():
            if key in _TOP_KEYS:
                if key == "output.weight" and a.tie_word_embeddings:
                    continue  # HF stores the shared matrix once, as the embedding
                out[_TOP_KEYS[key]] = w
                continue
            m = _OURS_LAYER.match(key)
            if m is None or m.group(2) not in _LAYER_KEYS:
                raise KeyError(f"no Hugging Face name for {key!r}")
            if m.group(2) == "attention.wq.weight":
                w = _to_half_split(w, a.n_heads)
            elif m.group(2) == "attention.wk.weight":
                w = _to_half_split(w, a.kv_heads)
            out[f"model.layers.{m.group(1)}.{_LAYER_KEYS[m.group(2)]}"] = w.contiguous()
        return out

    def from_hf(self, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        a = self.args
        out: dict[str, torch.Tensor] = {}
        for key, w in hf.items():
            if key in _HF_TOP_KEYS:
                out[_HF_TOP_KEYS[key]] = w
                continue
            m = _HF_LAYER.match(key)
            if m is None or m.group(2) not in _HF_LAYER_KEYS:
                if key.endswith("rotary_emb.inv_freq"):
                    continue  # a buffer some exports include; recomputed from the config
                raise KeyError(f"unexpected Hugging Face key {key!r}")
            ours = _HF_LAYER_KEYS[m.group(2)]
            if ours == "attention.wq.weight":
                w = _to_interleaved(w, a.n_heads)
            elif ours == "attention.wk.weight":
                w = _to_interleaved(w, a.kv_heads)
            out[f"layers.{m.group(1)}.{ours}"] = w.contiguous()
        if a.tie_word_embeddings and "output.weight" not in out:
            out["output.weight"] = out["tok_embeddings.weight"]
        return out

    def hf_config(self, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """``config.json`` for ``transformers.LlamaForCausalLM`` with these model arguments."""
        a = self.args
        config: dict[str, Any] = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": a.vocab_size,
            "hidden_size": a.dim,
            "intermediate_size": a.hidden_dim,
            "num_hidden_layers": a.n_layers,
            "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.kv_heads,
            "head_dim": a.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": a.norm_eps,
            "rope_theta": a.rope_theta,
            "max_position_embeddings": a.max_seq_len,
            "tie_word_embeddings": a.tie_word_embeddings,
            "attention_bias": False,
            "mlp_bias": False,
            "torch_dtype": str(dtype).removeprefix("torch."),
            "rope_scaling": None,
        }
        if a.rope_scaling_factor is not None:
            config["rope_scaling"] = {
                "rope_type": "llama3",
                "factor": a.rope_scaling_factor,
                "low_freq_factor": a.rope_low_freq_factor,
                "high_freq_factor": a.rope_high_freq_factor,
                "original_max_position_embeddings": a.rope_original_max_seq_len,
            }
        return config


def args_from_hf_config(config: dict[str, Any]) -> ModelArgs:
    """Our ModelArgs for a Hugging Face Llama ``config.json`` (the SwiGLU width is matched with
    ``multiple_of = intermediate_size``, so any width round-trips)."""
    # transformers >= 5 writes ``rope_parameters`` (theta included); older ones ``rope_theta``
    # and ``rope_scaling``.
    rope = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or (rope if rope.get("rope_type") == "llama3" else {})
    args = ModelArgs(
        dim=config["hidden_size"],
        n_layers=config["num_hidden_layers"],
        n_heads=config["num_attention_heads"],
        n_kv_heads=config.get("num_key_value_heads"),
        vocab_size=config["vocab_size"],
        multiple_of=config["intermediate_size"],
        norm_eps=config.get("rms_norm_eps", 1e-5),
        rope_theta=config.get("rope_theta", rope.get("rope_theta", 10000.0)),
        rope_scaling_factor=scaling.get("factor") if scaling else None,
        rope_low_freq_factor=scaling.get("low_freq_factor", 1.0),
        rope_high_freq_factor=scaling.get("high_freq_factor", 4.0),
        rope_original_max_seq_len=scaling.get("original_max_position_embeddings", 8192),
        max_seq_len=config.get("max_position_embeddings", 8192),
        tie_word_embeddings=config.get("tie_word_embeddings", False),
    )
    if args.hidden_dim != config["intermediate_size"]:
        raise ValueError(
            f"intermediate_size {config['intermediate_size']} cannot be expressed as a Llama 3 "
            f"SwiGLU width for dim {args.dim} (got {args.hidden_dim})"
        )
    return args
