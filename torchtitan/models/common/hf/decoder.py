"""The Hugging Face names and ``config.json`` fields every Llama-style decoder shares
(transformers' ``LlamaForCausalLM`` layout, also Qwen3's): a family's :class:`HFMapping` starts
from these and adds what is its own (docs/extending.md, section 5).

RoPE: our ``apply_rotary_emb`` rotates adjacent channel pairs of each head, transformers'
``rotate_half`` the two halves, so the rows of ``wq`` and ``wk`` are permuted within each head
(:class:`RopeRows`); per-head QK-norm weights run on the same channels and are permuted alike.
"""

from __future__ import annotations

from typing import Any

from torchtitan.models.common.hf.config import ConfigField
from torchtitan.models.common.hf.keys import HFKey, irrelevant, mapped, only, refused
from torchtitan.models.common.hf.mapping import RopeRows, TensorTransform

DECODER_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
ATTENTION = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
}
QK_NORM = {
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}
BLOCK_NORMS = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
SWIGLU = {
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}
ROPE_QK: dict[str, TensorTransform] = {
    "attention.wq.weight": RopeRows("n_heads"),
    "attention.wk.weight": RopeRows("kv_heads"),
}
ROPE_QK_NORM: dict[str, TensorTransform] = {name: RopeRows(None) for name in QK_NORM}
DECODER_CONSTANTS = {"hidden_act": "silu", "attention_bias": False}


def decoder_constants(architecture: str, model_type: str, **extra: Any) -> dict[str, Any]:
    """A family's fixed ``config.json`` entries: its class and type, :data:`DECODER_CONSTANTS`
    and ``extra`` (which may override them)."""
    return {"architectures": [architecture], "model_type": model_type, **DECODER_CONSTANTS, **extra}


def yarn_to_hf(
    factor: float, original_max_seq_len: int, beta_fast: float, beta_slow: float
) -> dict[str, Any]:
    """The YaRN entries of ``rope_parameters`` a family with YaRN RoPE shares (it adds its own)."""
    return {
        "rope_type": "yarn",
        "factor": factor,
        "original_max_position_embeddings": original_max_seq_len,
        "beta_fast": beta_fast,
        "beta_slow": beta_slow,
    }


def yarn_from_hf(rope: Any) -> dict[str, Any]:
    """:func:`yarn_to_hf`'s inverse: ``YarnScaling``'s ``factor``, ``original_max_seq_len``,
    ``beta_fast`` and ``beta_slow`` from ``rope_parameters`` (betas 32 and 1 when unset)."""
    return {
        "factor": float(rope["factor"]),
        "original_max_seq_len": int(rope["original_max_position_embeddings"]),
        "beta_fast": float(rope.get("beta_fast") or 32.0),
        "beta_slow": float(rope.get("beta_slow") or 1.0),
    }


def heads_of(config: Any) -> int:
    """``decoder_fields``'s ``kv_heads`` default for a family whose configs may omit
    ``num_key_value_heads``: one key/value head per query head."""
    return int(config["num_attention_heads"])


def _rope_theta(default: float) -> Any:
    # transformers >= 5 writes ``rope_parameters`` (theta included); older ones ``rope_theta``.
    return lambda config: (config.get("rope_parameters") or {}).get("rope_theta", default)


def decoder_fields(
    *, kv_heads: Any, norm_eps: float, rope_theta: float, max_seq_len: int
) -> tuple[ConfigField, ...]:
    """The shape fields every decoder's ``config.json`` holds; the arguments are the defaults
    used on import when a config lacks them (``kv_heads`` may be a callable of the config)."""
    return (
        ConfigField("vocab_size", "vocab_size"),
        ConfigField("hidden_size", "dim"),
        ConfigField("num_hidden_layers", "n_layers"),
        ConfigField("num_attention_heads", "n_heads"),
        ConfigField("num_key_value_heads", "n_kv_heads", "kv_heads", kv_heads),
        ConfigField("rms_norm_eps", "norm_eps", default=norm_eps),
        ConfigField("rope_theta", "rope_theta", default=_rope_theta(rope_theta)),
        ConfigField("max_position_embeddings", "max_seq_len", default=max_seq_len),
        ConfigField("tie_word_embeddings", "tie_word_embeddings", default=False),
    )


def decoder_keys() -> tuple[HFKey, ...]:
    """The key-table entries (``keys.py``) of :func:`decoder_fields` and the Llama-style
    activation: a family's ``hf_keys.py`` starts from these."""
    return (
        mapped("vocab_size", "vocab_size"),
        mapped("hidden_size", "dim"),
        mapped("num_hidden_layers", "n_layers"),
        mapped("num_attention_heads", "n_heads"),
        mapped("num_key_value_heads", "n_kv_heads"),
        mapped("rms_norm_eps", "norm_eps"),
        mapped("rope_theta", "rope_theta"),
        mapped("max_position_embeddings", "max_seq_len (training replaces it by training.seq_len)"),
        mapped("tie_word_embeddings", "tie_word_embeddings"),
        mapped(
            "hidden_act", "the SwiGLU gate (SiLU)", only("silu", what="our SwiGLU computes SiLU")
        ),
    )


def no_window_keys(family: str) -> tuple[HFKey, ...]:
    """The sliding-window keys of Qwen-style configs, refused with a window for a family
    without one."""
    why = f"{family} has no sliding-window attention"
    return (
        refused("use_sliding_window", why),
        refused("sliding_window", why),
        irrelevant("max_window_layers", "selects windowed layers only with use_sliding_window"),
        refused(
            "layer_types",
            why,
            lambda v: v is None or all(t == "full_attention" for t in v),
        ),
    )
