"""Every DeepSeek-V3 ``config.json`` key and what we do with it (``models/common/hf/keys.py``;
generated into docs/hf_io.md, "Config keys"). ``attention_bias`` and ``num_nextn_predict_layers``
are listed as mapped: their conversion (projection biases, the MTP layers) is the DeepSeek-V3
adapter's (``hf.py``)."""

from __future__ import annotations

from torchtitan.models.common.hf.decoder import decoder_keys, no_window_keys
from torchtitan.models.common.hf.keys import KeyTable, irrelevant, mapped, only, refused
from torchtitan.models.common.hf.rope import rope_keys

_DERIVED = "transformers derives it from the head widths (a stored value is overwritten)"

DEEPSEEK_V3_KEYS = KeyTable(
    "deepseek_v3",
    (
        *decoder_keys(),
        *rope_keys(
            "rope_factor, rope_original_max_seq_len, rope_beta_*, rope_mscale*",
            ("default", "yarn", "deepseek_yarn"),
        ),
        *no_window_keys("deepseek_v3"),
        mapped("intermediate_size", "intermediate_size (dense blocks)"),
        mapped("q_lora_rank", "q_lora_rank (null: 0, a full query projection)"),
        mapped("kv_lora_rank", "kv_lora_rank"),
        mapped("qk_nope_head_dim", "qk_nope_head_dim"),
        mapped("qk_rope_head_dim", "qk_rope_head_dim"),
        mapped("v_head_dim", "v_head_dim"),
        irrelevant("head_dim", _DERIVED),
        irrelevant("qk_head_dim", _DERIVED),
        mapped(
            "rope_interleave",
            "adjacent-pair RoPE (ours)",
            only(True, what="half-split RoPE is not implemented"),
        ),
        mapped("num_nextn_predict_layers", "mtp_depth (the MTP layers: hf.py)"),
        mapped("attention_bias", "the projection biases"),
        mapped("first_k_dense_replace", "n_dense_layers"),
        mapped("n_routed_experts", "moe.num_experts"),
        mapped("num_local_experts", "moe.num_experts"),
        mapped("num_experts_per_tok", "moe.top_k"),
        mapped("moe_intermediate_size", "moe.expert_dim"),
        mapped("n_shared_experts", "moe.num_shared_experts"),
        mapped("norm_topk_prob", "moe.route_norm"),
        mapped("routed_scaling_factor", "moe.route_scale"),
        mapped("n_group", "moe.n_groups"),
        mapped("topk_group", "moe.topk_groups"),
        mapped("scoring_func", "moe.score_func", only("sigmoid", what="DeepSeek-V3's routing")),
        mapped("topk_method", "group-limited top-k with the correction bias", only("noaux_tc")),
        mapped("moe_layer_freq", "every block from first_k_dense_replace on is MoE", only(1)),
        irrelevant(
            "aux_loss_alpha",
            "transformers' DeepSeek-V3 has no such loss; ours balances with the routing bias",
        ),
        irrelevant(
            "seq_aux",
            "transformers' DeepSeek-V3 has no such loss; ours balances with the routing bias",
        ),
        irrelevant(
            "ep_size", "a layout of the original code; ours is parallelism.expert_parallel_degree"
        ),
        irrelevant("pretraining_tp", "transformers 4 sliced its matmuls by it: the same function"),
        refused(
            "quantization_config", "quantized (FP8) weights are not read; dequantize to bf16 first"
        ),
    ),
)
"""DeepSeek-V3's ``config.json`` keys."""
