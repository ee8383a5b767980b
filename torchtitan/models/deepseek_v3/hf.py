"""DeepSeek-V3's Hugging Face format (``DeepseekV3ForCausalLM``), declared for the shared adapter
(``models/common/hf/``; docs/deepseek_v3.md):

- MLA: ``self_attn.{q_proj | q_a_proj, q_a_layernorm, q_b_proj}``, ``kv_a_proj_with_mqa``,
  ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``. No RoPE permutation: transformers' DeepSeek-V3
  (``rope_interleave``, its default) rotates adjacent channel pairs as we do and writes queries
  and keys in the same channel order, so the scores are equal; ``rope_interleave: false`` is
  refused on import;
- dense blocks ``mlp.{gate,up,down}_proj``; MoE blocks ``mlp.gate`` (router) with its
  ``e_score_correction_bias`` (our auxiliary-loss-free ``expert_bias``), ``mlp.experts``
  (per-expert or fused) and ``mlp.shared_experts``;
- the MTP modules as the release stores them: layer ``n_layers + k`` with ``enorm``, ``hnorm``,
  ``eh_proj``, ``shared_head.norm``, the block's tensors, and copies of the embedding and the
  output head (``embed_tokens``, ``shared_head.head``: written on export, dropped on import since
  ours are shared); transformers' model itself has no MTP and ignores them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

import torch

from torchtitan.config.errors import ConfigError
from torchtitan.models.common.hf import ConfigField, ExpertStack, HFConfig, HFMapping
from torchtitan.models.common.hf import StateDictAdapter as SharedAdapter
from torchtitan.models.common.hf.decoder import (
    BLOCK_NORMS,
    DECODER_TOP,
    SWIGLU,
    decoder_constants,
    decoder_fields,
    heads_of,
    yarn_from_hf,
    yarn_to_hf,
)
from torchtitan.models.common.hf.mapping import Box, HFSource, box_shape
from torchtitan.models.common.moe import MoEArgs
from torchtitan.models.deepseek_v3.args import DeepSeekV3Args
from torchtitan.models.deepseek_v3.hf_keys import DEEPSEEK_V3_KEYS
from torchtitan.tools.logging import logger

MLA_NAMES = {
    f"attention.{ours}.weight": f"self_attn.{hf}.weight"
    for ours, hf in {
        "wq": "q_proj",
        "wq_a": "q_a_proj",
        "q_norm": "q_a_layernorm",
        "wq_b": "q_b_proj",
        "wkv_a": "kv_a_proj_with_mqa",
        "kv_norm": "kv_a_layernorm",
        "wkv_b": "kv_b_proj",
        "wo": "o_proj",
    }.items()
}
MLA_BIASES = {
    f"attention.{ours}.bias": f"self_attn.{hf}.bias"
    for ours, hf in {"wq_a": "q_a_proj", "wkv_a": "kv_a_proj_with_mqa", "wo": "o_proj"}.items()
}
"""``attention_bias: true``: transformers' biases (none on ``q_proj``, ``q_b_proj``, ``kv_b_proj``)."""
MOE_NAMES = {
    "moe.router.gate.weight": "mlp.gate.weight",
    "moe.router.expert_bias": "mlp.gate.e_score_correction_bias",
    "moe.shared.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "moe.shared.w2.weight": "mlp.shared_experts.down_proj.weight",
    "moe.shared.w3.weight": "mlp.shared_experts.up_proj.weight",
}
MTP_NAMES = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "norm.weight": "shared_head.norm.weight",
}
MTP_SHARED_COPIES = {
    "embed_tokens.weight": "tok_embeddings.weight",
    "shared_head.head.weight": "output.weight",
}


_HF_DEFAULTS: dict[str, Any] = {
    "first_k_dense_replace": 3,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "n_group": 8,
    "topk_group": 4,
}
"""transformers' ``DeepseekV3Config`` defaults of the MoE keys: a ``config.json`` that leaves
one out (hand-written, or a multimodal config's ``text_config``) means what transformers
builds from it, so an absent key is read as its default, not as a neutral value."""


class _MoESection:
    """``DeepseekV3Config``'s routing fields <-> ``moe`` and ``n_dense_layers``."""

    def to_hf(self, a: DeepSeekV3Args) -> dict[str, Any]:
        m = a.moe
        if m is None:
            return {"first_k_dense_replace": a.n_layers, "n_routed_experts": 1}
        if m.score_func != "sigmoid" or m.num_shared_experts == 0:
            raise ValueError("DeepseekV3ForCausalLM routes with sigmoid scores and shared experts")
        return {
            "first_k_dense_replace": a.n_dense_layers,
            "n_routed_experts": m.num_experts,
            "num_experts_per_tok": m.top_k,
            "moe_intermediate_size": m.expert_dim,
            "n_shared_experts": m.num_shared_experts,
            "norm_topk_prob": m.route_norm,
            "routed_scaling_factor": m.route_scale,
            "n_group": m.n_groups,
            "topk_group": m.topk_groups,
        }

    def from_hf(self, config: Mapping[str, Any]) -> dict[str, Any]:
        config = {**_HF_DEFAULTS, **config}
        n_layers, dense = config["num_hidden_layers"], config["first_k_dense_replace"]
        if dense >= n_layers:
            return {"n_dense_layers": n_layers, "moe": None}
        moe = MoEArgs(
            num_experts=int(config.get("n_routed_experts") or config["num_local_experts"]),
            top_k=config["num_experts_per_tok"],
            expert_dim=config["moe_intermediate_size"],
            num_shared_experts=config["n_shared_experts"],
            score_func="sigmoid",
            route_norm=config["norm_topk_prob"],
            route_scale=config["routed_scaling_factor"],
            n_groups=config["n_group"] or 1,
            topk_groups=config["topk_group"] or 1,
            bias_update_rate=0.001,  # the released models' correction bias is used for routing
        )
        return {"n_dense_layers": dense, "moe": moe}


class _RopeSection:
    """YaRN: ``rope_parameters`` (transformers >= 5) or ``rope_scaling`` <-> the ``rope_*``
    fields; also the MLA head widths."""

    def to_hf(self, a: DeepSeekV3Args) -> dict[str, Any]:
        out: dict[str, Any] = {"q_lora_rank": a.q_lora_rank or None, "rope_interleave": True}
        params: dict[str, Any] = {"rope_type": "default", "rope_theta": a.rope_theta}
        if a.rope_factor != 1.0:
            yarn = (a.rope_original_max_seq_len, a.rope_beta_fast, a.rope_beta_slow)
            params.update(yarn_to_hf(a.rope_factor, *yarn))
            params.update(mscale=a.rope_mscale, mscale_all_dim=a.rope_mscale_all_dim)
        return {**out, "rope_parameters": params, "rope_scaling": params}

    def from_hf(self, config: Mapping[str, Any]) -> dict[str, Any]:
        if config.get("rope_interleave", True) is False:
            raise ValueError("rope_interleave=false (half-split RoPE) is not supported")
        p = config.get("rope_parameters") or config.get("rope_scaling") or {}
        out: dict[str, Any] = {"q_lora_rank": config.get("q_lora_rank") or 0}
        if p.get("rope_type", p.get("type", "default")) in ("yarn", "deepseek_yarn"):
            out.update({f"rope_{k}": v for k, v in yarn_from_hf(p).items()})
            out.update(
                rope_mscale=float(p.get("mscale") or 0),
                rope_mscale_all_dim=float(p.get("mscale_all_dim") or 0),
            )
        return out


def _mtp_layers(config: Mapping[str, Any]) -> int:
    # transformers' attribute name for it (``attribute_map``), should a config carry that one.
    return int(config.get("num_mtp_layers") or 0)


_CONFIG = HFConfig(
    make_args=DeepSeekV3Args,
    constants=decoder_constants("DeepseekV3ForCausalLM", "deepseek_v3"),
    fields=(
        *decoder_fields(kv_heads=heads_of, norm_eps=1e-6, rope_theta=10000.0, max_seq_len=4096),
        ConfigField("intermediate_size", "intermediate_size"),
        ConfigField("kv_lora_rank", "kv_lora_rank"),
        ConfigField("qk_nope_head_dim", "qk_nope_head_dim"),
        ConfigField("qk_rope_head_dim", "qk_rope_head_dim"),
        ConfigField("v_head_dim", "v_head_dim"),
        ConfigField("attention_bias", "attention_bias", default=False),
        ConfigField("num_nextn_predict_layers", "mtp_depth", default=_mtp_layers),
    ),
    sections=(_MoESection(), _RopeSection()),
    keys=DEEPSEEK_V3_KEYS,
)

DEEPSEEK_V3_HF = HFMapping(
    top=DECODER_TOP,
    layer={**MLA_NAMES, **MLA_BIASES, **BLOCK_NORMS, **SWIGLU, **MOE_NAMES},
    transforms={},
    experts=ExpertStack(
        ours="moe.experts", fused={"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}
    ),
    config=_CONFIG,
)
"""DeepSeek-V3 <-> ``DeepseekV3ForCausalLM`` (the main model; :class:`DeepSeekV3Adapter` adds
the MTP layers)."""


class DeepSeekV3Adapter(SharedAdapter):
    """The shared adapter, plus the MTP modules as HF layers ``n_layers + k``: whole state dicts
    (``to_hf``/``from_hf``) and one tensor or box at a time (``to_hf_one``/``from_hf_box``, the
    streamed import and export of ``checkpoint/hf_io.py``)."""

    def __init__(self, mapping: HFMapping, args: DeepSeekV3Args) -> None:
        super().__init__(mapping, args)
        self._mtp = re.compile(r"^mtp\.(\d+)\.(.+)$")

    def _mtp_layer(self, key: str) -> tuple[int, str] | None:
        """(HF layer index, name inside the module) of our MTP tensor ``key``, else None."""
        found = self._mtp.match(key)
        return None if found is None else (self.args.n_layers + int(found[1]), found[2])

    def peft_key(self, key: str) -> str:
        """Our weight ``key`` as the PEFT export names it (``lora/peft_io.py``): an MTP block's
        tensor under the shared mapping's layer ``n_layers + k``, an MTP projection under its
        Hugging Face name; other keys unchanged."""
        found = self._mtp_layer(key)
        if found is None:
            return key
        layer, name = found
        if name.startswith("block."):
            return f"layers.{layer}.{name.removeprefix('block.')}"
        if name not in MTP_NAMES:
            raise KeyError(f"no Hugging Face name for {key!r}")
        return f"model.layers.{layer}.{MTP_NAMES[name]}"

    def to_hf_one(
        self, key: str, w: torch.Tensor, check: bool = True
    ) -> list[tuple[str, torch.Tensor]]:
        """The shared mapping; an MTP tensor under its layer ``n_layers + k``; the embedding
        (and the untied head) also as each MTP layer's copy (``embed_tokens``,
        ``shared_head.head``), as the release stores them."""
        if self._mtp_layer(key) is None:
            return super().to_hf_one(key, w, check) + self._copies(key, w)
        inner = self.peft_key(key)  # the block's tensors under the layer's HF names
        return [(inner, w)] if inner.startswith("model.") else super().to_hf_one(inner, w, check)

    def _copies(self, key: str, w: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        hf = [n for n, ours in MTP_SHARED_COPIES.items() if ours == key]
        if self._tied and key == self.mapping.tied[1]:  # the head is the embedding
            hf.append("shared_head.head.weight")
        n = self.args.n_layers
        # Cloned: saved apart (safetensors refuses tensors sharing storage).
        return [
            (f"model.layers.{n + k}.{h}", w.clone()) for k in range(self.args.mtp_depth) for h in hf
        ]

    def from_hf_box(
        self, key: str, shape: tuple[int, ...], box: Box, source: HFSource
    ) -> torch.Tensor:
        if self._mtp_layer(key) is None:
            return super().from_hf_box(key, shape, box, source)
        inner = self.peft_key(key)
        if not inner.startswith("model."):
            return super().from_hf_box(inner, shape, box, source)
        if any(s.stop <= s.start for s in box):
            return torch.empty(box_shape(box))
        return source.read(inner, box)

    def mtp_layers_in(self, names: Iterable[str]) -> int:
        """How many of our ``mtp_depth`` MTP layers the HF tensor ``names`` hold (from the
        first: layers ``n_layers``, ``n_layers + 1``, ...)."""
        have, n = set(names), self.args.n_layers
        depth = 0
        while depth < self.args.mtp_depth and f"model.layers.{n + depth}.eh_proj.weight" in have:
            depth += 1
        return depth

    def args_for_weights(self, names: Iterable[str]) -> DeepSeekV3Args:
        """The args for a folder holding the HF tensor ``names`` (the converter's and the
        evaluation's import, whose args come from its ``config.json``): a config that declares
        MTP layers the weights lack (transformers' ``save_pretrained`` writes
        ``num_nextn_predict_layers: 1`` and no MTP weights) imports the trunk with the MTP
        layers present, and says so (docs/deepseek_v3.md, "Hugging Face")."""
        present = self.mtp_layers_in(names)
        if present == self.args.mtp_depth:
            return self.args
        logger.warning(
            f"deepseek_v3: config.json declares num_nextn_predict_layers={self.args.mtp_depth} "
            f"but the weights hold {present} multi-token-prediction layers (model.layers."
            f"{self.args.n_layers + present}.* is absent): importing mtp_depth={present}"
        )
        return replace(self.args, mtp_depth=present)

    def check_source(self, source: HFSource, folder: Any) -> None:
        """Before the streamed import reads a byte: a model with MTP modules (``mtp_depth``)
        needs their layers in the folder; a folder without them is refused in one line rather
        than leaving the modules uninitialised."""
        depth, n = self.args.mtp_depth, self.args.n_layers
        have = sum(f"model.layers.{n + k}.eh_proj.weight" in source for k in range(depth))
        if have < depth:
            raise ConfigError(
                "model.mtp_depth",
                depth,
                f"{folder} holds {have} multi-token-prediction layers (model.layers.{n + have}"
                ".eh_proj.weight is absent; transformers' save_pretrained writes none)",
                f"set --model.mtp_depth {have} (0: train without MTP), or load a folder with "
                "the MTP layers (the published DeepSeek-V3 checkpoints hold them)",
            )

    def from_hf(self, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        n, depth = self.args.n_layers, self.args.mtp_depth
        main, mtp = {}, {}
        for key, w in hf.items():
            found = self._hf_layer.match(key)
            if found is not None and int(found.group(1)) >= n:
                if int(found.group(1)) < n + depth:  # MTP layers we do not build: dropped
                    mtp[key] = w
            else:
                main[key] = w
        out = super().from_hf(main)
        hf_mtp = {v: k for k, v in MTP_NAMES.items()}
        blocks: dict[str, torch.Tensor] = {}
        for key, w in mtp.items():
            found = self._hf_layer.match(key)
            assert found is not None
            layer, name = int(found.group(1)), found.group(2)
            if name in hf_mtp:
                out[f"mtp.{layer - n}.{hf_mtp[name]}"] = w
            elif name not in MTP_SHARED_COPIES:  # those are our shared embedding and head
                blocks[key] = w
        for key, w in super().from_hf(blocks).items():  # "layers.<n + k>.<name>"
            _, block_id, rest = key.split(".", 2)
            out[f"mtp.{int(block_id) - n}.block.{rest}"] = w
        return out


def args_from_hf_config(config: Mapping[str, Any]) -> DeepSeekV3Args:
    """Our args for a Hugging Face DeepSeek-V3 ``config.json``."""
    args: DeepSeekV3Args = DEEPSEEK_V3_HF.config.args_from_hf(config)
    return args
