"""The Llama 3 parallel plan: the shared decoder layout of ``models/common/decoder_plan.py``
(which describes the tensor-parallel layout; docs/parallelisms.md), attention and a dense SwiGLU
in every block. The generic layers in ``distributed/`` apply it in a fixed order
(docs/architecture.md, section 5)."""

from __future__ import annotations

from torchtitan.distributed.model_plan import ModelParallelPlan
from torchtitan.models.common.decoder_plan import (
    attention_plan,
    decoder_divisible,
    decoder_parallel_plan,
    pipeline_units,
    swiglu_plan,
)
from torchtitan.models.llama3.args import ModelArgs


def llama3_parallel_plan(args: ModelArgs) -> ModelParallelPlan:
    block = {**attention_plan(), **swiglu_plan()}
    return decoder_parallel_plan(args, block, decoder_divisible(args))


__all__ = ["llama3_parallel_plan", "pipeline_units"]
