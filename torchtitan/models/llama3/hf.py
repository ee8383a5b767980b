"""Llama 3's Hugging Face format (``LlamaForCausalLM``), declared for the shared adapter
(``models/common/hf/``; docs/extending.md, section 5): the Llama-style names, the RoPE row
permutation of ``wq``/``wk``, and the config translation, Llama 3.1's ``rope_scaling`` included.
The SwiGLU width is read back as ``multiple_of = intermediate_size``, so any width round-trips.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torchtitan.models.common.hf import ConfigField, HFConfig, HFMapping
from torchtitan.models.common.hf.decoder import (
    ATTENTION,
    BLOCK_NORMS,
    DECODER_TOP,
    ROPE_QK,
    SWIGLU,
    decoder_constants,
    decoder_fields,
)
from torchtitan.models.llama3.args import ModelArgs


class _RopeScaling:
    """``rope_scaling`` (``rope_type: llama3``) <-> the ``rope_*`` scaling fields."""

    def to_hf(self, a: ModelArgs) -> dict[str, Any]:
        if a.rope_scaling_factor is None:
            return {"rope_scaling": None}
        scaling = {
            "rope_type": "llama3",
            "factor": a.rope_scaling_factor,
            "low_freq_factor": a.rope_low_freq_factor,
            "high_freq_factor": a.rope_high_freq_factor,
            "original_max_position_embeddings": a.rope_original_max_seq_len,
        }
        return {"rope_scaling": scaling}

    def from_hf(self, config: Mapping[str, Any]) -> dict[str, Any]:
        # transformers >= 5 writes ``rope_parameters``; older ones ``rope_scaling``.
        rope = config.get("rope_parameters") or {}
        scaling = config.get("rope_scaling") or (rope if rope.get("rope_type") == "llama3" else {})
        return {
            "rope_scaling_factor": scaling.get("factor") if scaling else None,
            "rope_low_freq_factor": scaling.get("low_freq_factor", 1.0),
            "rope_high_freq_factor": scaling.get("high_freq_factor", 4.0),
            "rope_original_max_seq_len": scaling.get("original_max_position_embeddings", 8192),
        }


def _check_swiglu_width(args: ModelArgs, config: Mapping[str, Any]) -> None:
    if args.hidden_dim != config["intermediate_size"]:
        raise ValueError(
            f"intermediate_size {config['intermediate_size']} cannot be expressed as a Llama 3 "
            f"SwiGLU width for dim {args.dim} (got {args.hidden_dim})"
        )


_CONFIG = HFConfig(
    make_args=ModelArgs,
    constants=decoder_constants("LlamaForCausalLM", "llama", mlp_bias=False),
    fields=(
        *decoder_fields(kv_heads=None, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=8192),
        ConfigField("head_dim", None, "head_dim"),
        ConfigField("intermediate_size", "multiple_of", "hidden_dim"),
    ),
    sections=(_RopeScaling(),),
    check=_check_swiglu_width,
)

LLAMA3_HF = HFMapping(
    top=DECODER_TOP,
    layer={**ATTENTION, **SWIGLU, **BLOCK_NORMS},
    transforms=ROPE_QK,
    config=_CONFIG,
)
"""Llama 3 <-> ``LlamaForCausalLM``."""


def args_from_hf_config(config: Mapping[str, Any]) -> ModelArgs:
    """Our args for a Hugging Face Llama ``config.json``."""
    args: ModelArgs = LLAMA3_HF.config.args_from_hf(config)
    return args
