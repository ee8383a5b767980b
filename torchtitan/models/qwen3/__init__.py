"""Qwen3 dense and Qwen3-MoE decoder-only transformers: arguments, flavors, the module, its
parallel plan and its Hugging Face mapping (docs/moe.md for the MoE layer)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from torch import nn

from torchtitan.distributed.model_plan import ModelParallelPlan
from torchtitan.models.qwen3.args import QWEN3_FLAVORS, Qwen3Args
from torchtitan.models.qwen3.model import Transformer
from torchtitan.models.qwen3.parallel_plan import qwen3_parallel_plan
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter


@dataclass(frozen=True)
class Qwen3Spec:
    """The ``ModelSpec`` of the Qwen3 family (see ``torchtitan/models/spec.py``)."""

    name: str = "qwen3"
    flavors: Mapping[str, Qwen3Args] = field(default_factory=lambda: QWEN3_FLAVORS)

    def build(self, args: Qwen3Args) -> nn.Module:
        return Transformer(args)

    def parallel_plan(self, args: Qwen3Args) -> ModelParallelPlan:
        return qwen3_parallel_plan(args)

    def num_params(self, args: Qwen3Args) -> int:
        return args.num_params()

    def flops_per_token(self, args: Qwen3Args, seq_len: int) -> int:
        return args.flops_per_token(seq_len)

    def state_dict_adapter(self, args: Qwen3Args) -> Qwen3StateDictAdapter:
        return Qwen3StateDictAdapter(args)


qwen3_spec = Qwen3Spec()

__all__ = ["QWEN3_FLAVORS", "Qwen3Args", "Qwen3Spec", "Transformer", "qwen3_spec"]
