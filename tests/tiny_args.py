"""Tiny hand-sized args of the real families, for the tests that build a model in a few
milliseconds (HF parity, generation, MoE metrics): one place for the shapes they share, each
test overriding what it needs."""

from __future__ import annotations

from typing import Any

from torchtitan.models.common.moe import MoEArgs
from torchtitan.models.common.rope import Llama3Scaling, YarnScaling
from torchtitan.models.deepseek_v3 import DeepSeekV3Args
from torchtitan.models.deepseek_v3.args import group_routed_experts
from torchtitan.models.gpt_oss import GptOssArgs
from torchtitan.models.llama3 import ModelArgs
from torchtitan.models.qwen3 import Qwen3Args

THREE_BLOCKS: dict[str, Any] = dict(dim=64, n_layers=3, n_heads=4, vocab_size=256, max_seq_len=64)
"""The shape tiny_gpt_oss and tiny_deepseek_v3 share: three blocks of width 64, 4 heads."""


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


def tiny_gpt_oss(window: int = 8, **extra: Any) -> GptOssArgs:
    """Three blocks (sliding, full, sliding; ``window`` keys) of 4 query / 2 key-value heads of
    16 channels, 4 experts of width 32 (top-2) clamping at 0.5, YaRN (factor 4 over 16 original
    positions) and a 64-position table unless ``extra`` says otherwise."""
    shape: dict[str, Any] = dict(
        THREE_BLOCKS,
        n_kv_heads=2,
        head_dim=16,
        moe=MoEArgs(num_experts=4, top_k=2, expert_dim=32),
        yarn=YarnScaling(4.0, 16, truncate=False),
        swiglu_limit=0.5,  # tiny activations: a clamp that cuts (7.0 published)
    )
    shape.update(extra)
    return GptOssArgs(sliding_window=window, **shape)


def tiny_deepseek_v3(**extra: Any) -> DeepSeekV3Args:
    """Three blocks (one dense, two MoE with 8 sigmoid-routed experts in 2 groups and a shared
    one) of 4 MLA heads (query and key/value latents of 32, 16 + 8 rotated channels, values of
    16), YaRN RoPE over a 64-position table, no MTP unless ``extra`` says otherwise."""
    moe = group_routed_experts(
        num_experts=8, top_k=2, expert_dim=32, n_groups=2, topk_groups=1, route_scale=2.5
    )
    shape: dict[str, Any] = dict(
        THREE_BLOCKS,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        intermediate_size=96,
        n_dense_layers=1,
        moe=moe,
        rope_factor=4.0,
        rope_original_max_seq_len=16,
        rope_mscale=1.0,
        rope_mscale_all_dim=1.0,
        mtp_depth=0,
    )
    shape.update(extra)
    return DeepSeekV3Args(**shape)


def tiny_qwen3_5(**extra: Any) -> Any:
    """Qwen3.5 of width 64: DeltaNet, attention, DeltaNet, attention (2 key / 4 value DeltaNet
    heads of 8 / 12), half of each 16-wide attention head rotated, tied embeddings."""
    from torchtitan.models.qwen3_5 import Qwen35Args

    shape: dict[str, Any] = dict(
        dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, intermediate_size=96,
        vocab_size=256, max_seq_len=64, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=12, partial_rotary_factor=0.5,
        tie_word_embeddings=True,
    )  # fmt: skip
    shape.update(extra)
    n = shape["n_layers"]
    kinds = ("linear_attention", "full_attention")
    shape.setdefault("layer_types", tuple(kinds[i % 2] for i in range(n)))
    return Qwen35Args(**shape)


def tiny_qwen3_5_vl(**extra: Any) -> Any:
    """:func:`tiny_qwen3_5` with a 2-block, 32-wide vision tower over 4-pixel patches (a 4 x 4
    position table), the placeholder id 250."""
    import dataclasses

    from torchtitan.models.common.vision import VisionArgs
    from torchtitan.models.qwen3_5_vl import Qwen35VLArgs

    text = tiny_qwen3_5(**extra)
    tower = VisionArgs(
        depth=2, dim=32, n_heads=2, intermediate_size=48, out_dim=text.dim, patch_size=4,
        num_position_embeddings=16,
    )  # fmt: skip
    fields = {f.name: getattr(text, f.name) for f in dataclasses.fields(text)}
    return Qwen35VLArgs(**fields, vision=tower, image_token_id=250, mrope_section=(2, 1, 1))


def tiny_kimi_k25(**extra: Any) -> Any:
    """:func:`tiny_deepseek_v3` (no MTP) fed by a 2-block, 32-wide MoonViT over 4-pixel patches
    (a 4 x 4 position table), the placeholder id 250, an untied head."""
    import dataclasses

    from torchtitan.models.common.vision.moonvit import MoonViTArgs
    from torchtitan.models.kimi_k25 import KimiK25Args

    image_token_id = extra.pop("image_token_id", 250)
    text = tiny_deepseek_v3(**{"tie_word_embeddings": False, **extra})
    tower = MoonViTArgs(
        depth=2, dim=32, n_heads=2, intermediate_size=48, out_dim=text.dim, patch_size=4,
        pos_emb_height=4, pos_emb_width=4,
    )  # fmt: skip
    fields = {f.name: getattr(text, f.name) for f in dataclasses.fields(text)}
    return KimiK25Args(**fields, vision=tower, image_token_id=image_token_id)


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
            tiny_llama3(multiple_of=64, rope_scaling=Llama3Scaling(8.0, original_max_seq_len=32)),
        ),
        "qwen3": ("qwen3", tiny_qwen3()),
        "qwen3-moe": ("qwen3", moe),
        "gpt_oss": ("gpt_oss", tiny_gpt_oss()),
        "deepseek_v3": ("deepseek_v3", tiny_deepseek_v3()),
        "qwen3_5": ("qwen3_5", tiny_qwen3_5()),
        "qwen3_5-moe": (
            "qwen3_5",
            tiny_qwen3_5(
                n_layers=2,
                tie_word_embeddings=False,
                moe=MoEArgs(num_experts=8, top_k=2, expert_dim=32),
                shared_expert_dim=48,
            ),
        ),
        "qwen3_5_vl": ("qwen3_5_vl", tiny_qwen3_5_vl()),
        "kimi_k25": ("kimi_k25", tiny_kimi_k25()),
    }
