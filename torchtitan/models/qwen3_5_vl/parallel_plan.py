"""The parallel plan of Qwen3.5 with vision (docs/vlm.md, "Parallelism"): the decoder's FSDP
units as Qwen3.5's (``models/qwen3_5/parallel_plan.py``); the vision tower is data-parallel
work (each rank encodes its own images) with its own FSDP units: each tower block, then the
tower's remaining parameters (patch embedding, position table, merger). Tensor, pipeline and
context parallel are refused for now (one line at config validation)."""

from __future__ import annotations

import dataclasses

from torchtitan.distributed.model_plan import ModelParallelPlan
from torchtitan.models.qwen3_5.parallel_plan import qwen35_parallel_plan
from torchtitan.models.qwen3_5_vl.args import Qwen35VLArgs

_LATER = "not implemented yet for qwen3_5_vl (docs/vlm.md); use data parallel (FSDP)"


def qwen35_vl_parallel_plan(args: Qwen35VLArgs) -> ModelParallelPlan:
    plan = qwen35_parallel_plan(args)
    refusals = {
        "tensor_parallel": f"tensor parallel is {_LATER}",
        "pipeline_parallel": f"pipeline parallel is {_LATER}",
        "context_parallel": f"context parallel is {_LATER}",
    }
    tower = tuple(f"visual.blocks.{i}" for i in range(args.vision.depth)) + ("visual",)
    return dataclasses.replace(plan, document_mask=False, refusals=refusals, fsdp_units=tower)
