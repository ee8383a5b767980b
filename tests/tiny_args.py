"""Tiny hand-sized args of the real families, for the tests that build a model in a few
milliseconds (HF parity, generation, MoE metrics): one place for the shapes they share, each
test overriding what it needs."""

from __future__ import annotations

from typing import Any

from torchtitan.models.llama3 import ModelArgs
from torchtitan.models.qwen3 import Qwen3Args


def tiny_qwen3(
    dim: int = 64, heads: tuple[int, int] = (4, 2), ffn: int = 96, vocab: int = 256, **extra: Any
) -> Qwen3Args:
    """Two blocks of ``heads`` (query, key/value) heads of 16 channels, tied embeddings and a
    64-position RoPE table unless ``extra`` says otherwise."""
    shape: dict[str, Any] = dict(n_layers=2, head_dim=16, max_seq_len=64, tie_word_embeddings=True)
    shape.update(extra)
    n_heads, n_kv_heads = heads
    return Qwen3Args(
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        intermediate_size=ffn,
        vocab_size=vocab,
        **shape,
    )


def tiny_llama3(
    dim: int = 128, heads: tuple[int, int] = (8, 4), vocab: int = 512, **extra: Any
) -> ModelArgs:
    """Two blocks of ``heads`` (query, key/value) heads and a 64-position RoPE table unless
    ``extra`` says otherwise."""
    shape: dict[str, Any] = dict(n_layers=2, max_seq_len=64)
    shape.update(extra)
    n_heads, n_kv_heads = heads
    return ModelArgs(dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads, vocab_size=vocab, **shape)


def tiny_hf_cases() -> dict[str, tuple[str, Any]]:
    """One tiny flavor per Hugging Face layout of every family in ``MODELS``: case id ->
    (family name, args). GQA, RoPE scaling, QK-norms, tied and untied heads, dense and MoE
    layers mixed (layer 1 dense): every mapping of ``models/common/hf/`` is exercised."""
    import dataclasses

    from torchtitan.models.common.moe import MoEArgs

    moe = dataclasses.replace(
        tiny_qwen3(),
        n_layers=3,
        tie_word_embeddings=False,
        moe=MoEArgs(num_experts=8, top_k=2, expert_dim=32),
        moe_layers=(0, 2),
    )
    return {
        "llama3": (
            "llama3",
            tiny_llama3(multiple_of=64, rope_scaling_factor=8.0, rope_original_max_seq_len=32),
        ),
        "qwen3": ("qwen3", tiny_qwen3()),
        "qwen3-moe": ("qwen3", moe),
    }
