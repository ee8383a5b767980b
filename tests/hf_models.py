"""Tiny random transformers configs of architectures we do not implement natively, saved as
local folders for the ``hf`` family (docs/hf_models.md). No network: each comes from its
transformers config class."""

from __future__ import annotations

from pathlib import Path
from typing import Any

SHAPE: dict[str, Any] = dict(
    vocab_size=2048,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
    tie_word_embeddings=False,
)

ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "gemma3": ("Gemma3TextConfig", {"head_dim": 16, "sliding_window": 32}),
    "phi3": ("Phi3Config", {}),
    "olmo2": ("Olmo2Config", {}),
    "smollm3": ("SmolLM3Config", {}),
    "smollm3_tied": ("SmolLM3Config", {"tie_word_embeddings": True}),
    "granite": ("GraniteConfig", {"logits_scaling": 2.0, "residual_multiplier": 0.5}),
    "glm4": ("Glm4Config", {"head_dim": 16}),
    "olmoe": ("OlmoeConfig", {"num_experts": 4, "num_experts_per_tok": 2}),
}
"""Name -> (transformers config class, what differs from ``SHAPE``)."""

TP_PLANS = {"mistral", "gemma3", "phi3", "olmo2", "smollm3", "smollm3_tied", "granite", "glm4"}
"""The architectures whose transformers TP plan we apply (OLMoE's packs its experts)."""


def hf_config(arch: str, **overrides: Any) -> Any:
    import transformers

    name, extra = ARCHS[arch]
    return getattr(transformers, name)(**{**SHAPE, **extra, **overrides})


def save_config(arch: str, folder: Path, **overrides: Any) -> Path:
    """``folder`` holding the config.json of a tiny ``arch`` (no weights)."""
    folder.mkdir(parents=True, exist_ok=True)
    hf_config(arch, **overrides).save_pretrained(folder)
    return folder


def save_model(arch: str, folder: Path, seed: int = 0, **overrides: Any) -> Any:
    """``folder`` holding a tiny random ``arch`` with weights (safetensors); returns the model."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        hf_config(arch, **overrides), attn_implementation="sdpa", dtype=torch.float32
    )
    model.save_pretrained(folder)
    return model
