"""Llama 3's Hugging Face format (``LlamaForCausalLM``), declared for the shared adapter
(``models/common/hf/``; docs/extending.md, section 5): the Llama-style names, the RoPE row
permutation of ``wq``/``wk``, and the config translation, RoPE scaling included (``models/common/hf/rope.py``) and every key
checked (``hf_keys.py``).
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
from torchtitan.models.common.hf.keys import HFConfigError
from torchtitan.models.common.hf.rope import RopeSection
from torchtitan.models.llama3.args import ModelArgs
from torchtitan.models.llama3.hf_keys import LLAMA3_KEYS


def _check_swiglu_width(args: ModelArgs, config: Mapping[str, Any]) -> None:
    if args.hidden_dim != config["intermediate_size"]:
        raise HFConfigError(
            "config.json: intermediate_size",
            config["intermediate_size"],
            f"llama3: not a Llama 3 SwiGLU width for hidden_size {args.dim} (the width is "
            f"4 * dim * 2 / 3 rounded up to a multiple of intermediate_size: {args.hidden_dim})",
            "use a width that is a multiple of 8 * hidden_size / 3 rounded down, or import it as qwen3",
        )


_CONFIG = HFConfig(
    make_args=ModelArgs,
    constants=decoder_constants("LlamaForCausalLM", "llama", mlp_bias=False),
    fields=(
        *decoder_fields(kv_heads=None, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=8192),
        ConfigField("head_dim", None, "head_dim"),
        ConfigField("intermediate_size", "multiple_of", "hidden_dim"),
    ),
    sections=(RopeSection(),),
    keys=LLAMA3_KEYS,
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
