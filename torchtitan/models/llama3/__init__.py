"""Llama 3 (3, 3.1, 3.2 text) decoder-only transformer: arguments, flavors, the module, its
parallel plan and its Hugging Face mapping."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from torch import nn

from torchtitan.distributed.model_plan import ModelParallelPlan
from torchtitan.models.llama3.args import LLAMA3_FLAVORS, ModelArgs
from torchtitan.models.llama3.model import Transformer
from torchtitan.models.llama3.parallel_plan import llama3_parallel_plan
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter


@dataclass(frozen=True)
class Llama3Spec:
    """The ``ModelSpec`` of the Llama 3 family (see ``torchtitan/models/spec.py``)."""

    name: str = "llama3"
    flavors: Mapping[str, ModelArgs] = field(default_factory=lambda: LLAMA3_FLAVORS)

    def build(self, args: ModelArgs) -> nn.Module:
        return Transformer(args)

    def parallel_plan(self, args: ModelArgs) -> ModelParallelPlan:
        return llama3_parallel_plan(args)

    def num_params(self, args: ModelArgs) -> int:
        return args.num_params()

    def flops_per_token(self, args: ModelArgs, seq_len: int) -> int:
        return args.flops_per_token(seq_len)

    def state_dict_adapter(self, args: ModelArgs) -> Llama3StateDictAdapter:
        return Llama3StateDictAdapter(args)


llama3_spec = Llama3Spec()

__all__ = ["LLAMA3_FLAVORS", "Llama3Spec", "ModelArgs", "Transformer", "llama3_spec"]
