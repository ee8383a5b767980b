"""Qwen3.5's Hugging Face format (``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM``), declared
for the shared adapter (``models/common/hf/``; docs/extending.md, section 5; docs/qwen3_5.md):

- names: the Llama-style ones for embedding, norms, gated attention (``self_attn.q_proj`` holds
  each head's query and gate, as ours) and SwiGLU; the DeltaNet's ``linear_attn.*``; the MoE's
  router ``mlp.gate``, experts (per expert or fused), ``mlp.shared_expert`` and
  ``mlp.shared_expert_gate``;
- RoPE needs no permutation: ours rotates the two halves of the rotated channels, as
  transformers does;
- ``in_proj_qkv`` rows and ``conv1d`` channels: HF's [all q | all k | all v] <-> ours grouped by
  key head (:class:`GroupedQKV`, so tensor parallel can shard whole key heads);
- ``config.json``: the text config; a multimodal checkpoint's config (``text_config`` inside)
  is read too, its vision tower refused (``vision_problem``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from torchtitan.models.common.hf import (
    ConfigField,
    ExpertStack,
    HFConfig,
    HFMapping,
    OursOnly,
    StateDictAdapter,
)
from torchtitan.models.common.hf.decoder import BLOCK_NORMS, DECODER_TOP, SWIGLU
from torchtitan.models.common.hf.mapping import Box, HFSource, ReadBox
from torchtitan.models.common.moe import MoEArgs
from torchtitan.models.qwen3_5.args import Qwen35Args
from torchtitan.models.qwen3_5.hf_keys import QWEN35_KEYS


@dataclass(frozen=True)
class GroupedQKV:
    """Rows (dimension 0) of the DeltaNet's fused q/k/v tensors: HF [Q | K | V] <-> ours, per
    key head ``j``: ``[q_j | k_j | v of the value heads j serves]``. ``conv``: the tensor is the
    convolution weight, ``[C, 1, K]`` in HF, ``[C, K]`` here."""

    conv: bool = False

    @staticmethod
    def _segments(a: Qwen35Args) -> list[tuple[int, int, int]]:
        """Per row of ours in group order: (our offset in the group, HF start of head j's part
        minus j * part size, part size) for q, k, v."""
        dk, nk = a.linear_key_head_dim, a.linear_num_key_heads
        vsize = a.linear_value_dim // nk
        return [(0, 0, dk), (dk, nk * dk, dk), (2 * dk, 2 * nk * dk, vsize)]

    def to_hf(self, w: torch.Tensor, args: Any) -> torch.Tensor:
        nk = args.linear_num_key_heads
        g = w.reshape(nk, -1, *w.shape[1:])
        parts = [g[:, o : o + n].reshape(nk * n, *w.shape[1:]) for o, _, n in self._segments(args)]
        out = torch.cat(parts)
        return out[:, None] if self.conv else out

    def from_hf(self, w: torch.Tensor, args: Any) -> torch.Tensor:
        if self.conv:
            w = w[:, 0]
        nk = args.linear_num_key_heads
        sizes = [nk * n for _, _, n in self._segments(args)]
        parts = [p.reshape(nk, -1, *w.shape[1:]) for p in torch.split(w, sizes)]
        return torch.cat(parts, dim=1).reshape(w.shape)

    def from_hf_box(
        self, read: ReadBox, box: Box, shape: tuple[int, ...], args: Any
    ) -> torch.Tensor:
        """Only the box's rows: each key head's q, k and v runs that meet it."""
        rows, rest = box[0], box[1:]
        group = shape[0] // args.linear_num_key_heads
        pieces = []
        for j in range(rows.start // group, -(-rows.stop // group)):
            for offset, hf_base, n in self._segments(args):
                a = max(rows.start, j * group + offset)
                b = min(rows.stop, j * group + offset + n)
                if b > a:
                    start = hf_base + j * n + a - j * group - offset
                    hf_box = (slice(start, start + b - a), *((slice(0, 1),) if self.conv else ()))
                    piece = read((*hf_box, *rest))
                    pieces.append(piece[:, 0] if self.conv else piece)
        return torch.cat(pieces)


def _rope(config: Mapping[str, Any], key: str, default: float) -> float:
    rope = config.get("rope_parameters") or {}
    return float(rope.get(key, config.get(key, default)))


class _RopeSection:
    """``rope_parameters`` (theta and the partial rotary factor) <-> ours."""

    def to_hf(self, a: Qwen35Args) -> dict[str, Any]:
        rope = {"rope_type": "default", "rope_theta": a.rope_theta}
        return {"rope_parameters": {**rope, "partial_rotary_factor": a.partial_rotary_factor}}

    def from_hf(self, config: Mapping[str, Any]) -> dict[str, Any]:
        return {
            "rope_theta": _rope(config, "rope_theta", 1e7),
            "partial_rotary_factor": _rope(config, "partial_rotary_factor", 0.25),
        }


class _MoESection:
    """``Qwen3_5MoeForCausalLM``'s fields <-> ``moe`` and ``shared_expert_dim``."""

    def to_hf(self, a: Qwen35Args) -> dict[str, Any]:
        m = a.moe
        if m is None:
            return {"intermediate_size": a.intermediate_size}
        if m.num_shared_experts or m.score_func != "softmax" or m.n_groups > 1 or not m.route_norm:
            raise ValueError(
                "Qwen3.5-MoE routes by softmax top-k with normalized weights and one gated "
                "shared expert (shared_expert_dim): no other routing exports"
            )
        return {
            "architectures": ["Qwen3_5MoeForCausalLM"],
            "model_type": "qwen3_5_moe_text",
            "num_experts": m.num_experts,
            "num_experts_per_tok": m.top_k,
            "moe_intermediate_size": m.expert_dim,
            "shared_expert_intermediate_size": a.shared_expert_dim,
        }

    def from_hf(self, config: Mapping[str, Any]) -> dict[str, Any]:
        if "num_experts" not in config:
            return {"intermediate_size": config["intermediate_size"]}
        moe = MoEArgs(
            num_experts=config["num_experts"],
            top_k=config["num_experts_per_tok"],
            expert_dim=config["moe_intermediate_size"],
        )  # router_aux_loss_coef is not ours (hf_keys.py): MoEArgs' default, docs/moe.md
        return {"moe": moe, "shared_expert_dim": config["shared_expert_intermediate_size"]}


MULTIMODAL_TYPES = ("qwen3_5", "qwen3_5_moe")


class Qwen35HFConfig(HFConfig):
    """:class:`HFConfig` that also reads a multimodal ``config.json`` (its ``text_config``,
    with the top level's ``tie_word_embeddings``)."""

    def args_from_hf(self, config: Mapping[str, Any]) -> Any:
        if config.get("model_type") in MULTIMODAL_TYPES and "text_config" in config:
            text = dict(config["text_config"])
            text.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", False))
            config = text
        return super().args_from_hf(config)


def _layer_types(config: Mapping[str, Any]) -> tuple[str, ...]:
    from torchtitan.models.qwen3_5.args import interleaving

    n = config["num_hidden_layers"]
    types = config.get("layer_types") or interleaving(n, config.get("full_attention_interval", 4))
    return tuple(types)


_FIELDS = (
    ConfigField("vocab_size", "vocab_size"),
    ConfigField("hidden_size", "dim"),
    ConfigField("num_hidden_layers", "n_layers"),
    ConfigField("num_attention_heads", "n_heads"),
    ConfigField("num_key_value_heads", "n_kv_heads", "kv_heads"),
    ConfigField("head_dim", "head_dim"),
    ConfigField("rms_norm_eps", "norm_eps", default=1e-6),
    ConfigField("max_position_embeddings", "max_seq_len", default=262144),
    ConfigField("tie_word_embeddings", "tie_word_embeddings", default=False),
    ConfigField("layer_types", "layer_types", default=_layer_types),
    ConfigField("linear_num_key_heads", "linear_num_key_heads"),
    ConfigField("linear_num_value_heads", "linear_num_value_heads"),
    ConfigField("linear_key_head_dim", "linear_key_head_dim"),
    ConfigField("linear_value_head_dim", "linear_value_head_dim"),
    ConfigField("linear_conv_kernel_dim", "linear_conv_kernel_dim", default=4),
)


_CONFIG = Qwen35HFConfig(
    make_args=Qwen35Args,
    constants={
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "hidden_act": "silu",
        "attention_bias": False,
    },
    fields=_FIELDS,
    sections=(_RopeSection(), _MoESection()),
    keys=QWEN35_KEYS,
)

_NO_BIAS = (
    "auxiliary-loss-free balancing; Hugging Face's Qwen3.5-MoE has no routing bias, the "
    "exported model would route differently"
)
DELTANET = {
    "linear_attn.wqkv.weight": "linear_attn.in_proj_qkv.weight",
    "linear_attn.conv": "linear_attn.conv1d.weight",
    "linear_attn.wz.weight": "linear_attn.in_proj_z.weight",
    "linear_attn.wb.weight": "linear_attn.in_proj_b.weight",
    "linear_attn.wa.weight": "linear_attn.in_proj_a.weight",
    "linear_attn.A_log": "linear_attn.A_log",
    "linear_attn.dt_bias": "linear_attn.dt_bias",
    "linear_attn.norm.weight": "linear_attn.norm.weight",
    "linear_attn.wo.weight": "linear_attn.out_proj.weight",
}
GATED_ATTENTION = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}
MOE = {
    "feed_forward.router.gate.weight": "mlp.gate.weight",
    "feed_forward.shared_expert.w1.weight": "mlp.shared_expert.gate_proj.weight",
    "feed_forward.shared_expert.w2.weight": "mlp.shared_expert.down_proj.weight",
    "feed_forward.shared_expert.w3.weight": "mlp.shared_expert.up_proj.weight",
    "feed_forward.shared_gate.weight": "mlp.shared_expert_gate.weight",
}

QWEN35_HF = HFMapping(
    top=DECODER_TOP,
    layer={**GATED_ATTENTION, **DELTANET, **BLOCK_NORMS, **SWIGLU, **MOE},
    transforms={
        "linear_attn.wqkv.weight": GroupedQKV(),
        "linear_attn.conv": GroupedQKV(conv=True),
    },
    experts=ExpertStack(fused={"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}),
    ours_only={
        "feed_forward.router.expert_bias": OursOnly("feed_forward.router.gate.weight", _NO_BIAS)
    },
    config=_CONFIG,
    ignored_hf=("rotary_emb.inv_freq",),
)
"""Qwen3.5 / Qwen3.5-MoE <-> ``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM``."""


TEXT_PREFIX, MULTIMODAL_TEXT_PREFIX = "model.", "model.language_model."
NOT_TEXT = ("model.visual.", "mtp.")


def vision_problem(key: str) -> str:
    """The one-line error for a vision-tower or multi-token-prediction tensor handed to the
    text decoder."""
    return (
        f"{key!r} belongs to the vision tower or the MTP head of a multimodal Qwen3.5 "
        "checkpoint: the qwen3_5 family is the text decoder only. Fix: leave model.visual.* "
        "and mtp.* out (python -m torchtitan.convert reads only the text weights)"
    )


class _TextView:
    """An ``HFSource`` of a multimodal checkpoint seen with the text-only names
    (``model.language_model.X`` as ``model.X``; ``lm_head`` unchanged)."""

    def __init__(self, source: Any) -> None:
        self.source = source

    def _name(self, name: str) -> str:
        inner = MULTIMODAL_TEXT_PREFIX + name.removeprefix(TEXT_PREFIX)
        if name.startswith(TEXT_PREFIX) and name not in self.source and inner in self.source:
            return inner
        return name

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._name(name) in self.source

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.source.shape(self._name(name)))

    def read(self, name: str, box: Any) -> torch.Tensor:
        return self.source.read(self._name(name), box)


class Qwen35StateDictAdapter(StateDictAdapter):
    """The shared adapter over :data:`QWEN35_HF`, also reading the text decoder of the
    published multimodal checkpoints (``Qwen3_5ForConditionalGeneration``: the same names under
    ``model.language_model.``). Streamed reads (``from_hf_box``) never touch the vision tower;
    a whole state dict that holds it is refused (:func:`vision_problem`)."""

    def from_hf(self, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        text: dict[str, torch.Tensor] = {}
        for key, w in hf.items():
            if key.startswith(NOT_TEXT):
                raise ValueError(vision_problem(key))
            if key.startswith(MULTIMODAL_TEXT_PREFIX):
                key = TEXT_PREFIX + key.removeprefix(MULTIMODAL_TEXT_PREFIX)
            text[key] = w
        return super().from_hf(text)

    def from_hf_box(
        self, key: str, shape: tuple[int, ...], box: Box, source: HFSource
    ) -> torch.Tensor:
        return super().from_hf_box(key, shape, box, _TextView(source))
