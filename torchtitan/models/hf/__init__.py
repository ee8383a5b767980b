"""``hf``: any transformers causal LM, built from a local ``config.json`` or Hugging Face
folder (``model.flavor`` is its path), trained through our stack (docs/hf_models.md)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from torchtitan.distributed.model_plan import ModelParallelPlan
from torchtitan.models.hf.adapter import PassThroughAdapter
from torchtitan.models.hf.args import HFArgs, HFFlavors, flavor_key
from torchtitan.models.hf.model import build_hf_model
from torchtitan.models.hf.parallel_plan import hf_parallel_plan
from torchtitan.models.spec import NO_HOOKS, FamilyHooks

LORA_TARGETS = tuple(
    f"self_attn.{p}"
    for p in ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "query_key_value")
)
"""What ``lora.target_modules = []`` adapts: the attention projections under transformers'
usual names (those a model lacks are skipped)."""


@dataclass(frozen=True)
class HFSpec:
    """The :class:`ModelSpec` of the ``hf`` family. Counts come from the model built on
    ``meta`` (so they are exact for any architecture); FLOPs are the generic dense estimate
    ``6 N + 12 L H Dh S`` (a mixture of experts counts every expert: MFU reads low there)."""

    name: str = "hf"
    flavors: Mapping[str, HFArgs] = field(default_factory=HFFlavors)
    hf_model_types: tuple[str, ...] = ()
    lora_targets: tuple[str, ...] = LORA_TARGETS
    hooks: FamilyHooks = NO_HOOKS
    """transformers' modules: none of ours (MoE) to hook."""
    estimate_note: str = (
        "generic estimate (hf family): a dense decoder of this config's hidden size, layers, "
        "heads and intermediate size, not this architecture's own modules (docs/hf_models.md)"
    )
    """What the memory estimator says of its figures for this family (``planner/rank_memory.py``)."""

    def flavor_key(self, model: Any) -> str:
        """The ``flavors`` key of the model section: ``model.flavor``, carrying
        ``model.hf_trust_remote_code`` (``args.py``)."""
        return flavor_key(model.flavor, bool(model.hf_trust_remote_code))

    def build(self, args: HFArgs) -> nn.Module:
        return build_hf_model(args.config, trust_remote_code=args.trust_remote_code)

    def parallel_plan(self, args: HFArgs) -> ModelParallelPlan:
        return hf_parallel_plan(args)

    def num_params(self, args: HFArgs) -> int:
        return args.num_params()

    def flops_per_token(self, args: HFArgs, seq_len: int) -> int:
        # a tied matrix is also the output projection, a matmul
        dense = args.num_params(exclude_embedding=not args.tie_word_embeddings)
        attention = 12 * args.n_layers * args.n_heads * args.head_dim * seq_len
        return int(6 * dense + attention)

    def state_dict_adapter(self, args: HFArgs) -> Any:
        return PassThroughAdapter(args)


hf_spec = HFSpec()

__all__ = ["HFArgs", "HFSpec", "hf_spec"]
