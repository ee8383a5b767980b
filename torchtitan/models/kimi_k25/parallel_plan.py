"""The parallel plan of Kimi K2.5 (docs/vlm.md, "Parallelism"): the decoder's FSDP units as
DeepSeek-V3's (``models/deepseek_v3/parallel_plan.py``); the MoonViT tower is data-parallel
work (each rank encodes its own images) with its own FSDP units: each tower block, then the
tower's remaining parameters (patch embedding, position table, final norm), then the
projector. Tensor, pipeline and context parallel are refused for now (one line at config
validation), as for qwen3_5_vl."""

from __future__ import annotations

import dataclasses

from torchtitan.distributed.model_plan import ModelParallelPlan
from torchtitan.models.deepseek_v3.parallel_plan import deepseek_v3_parallel_plan
from torchtitan.models.kimi_k25.args import KimiK25Args

_LATER = "not implemented yet for kimi_k25 (docs/vlm.md); use data parallel (FSDP)"


def kimi_k25_parallel_plan(args: KimiK25Args) -> ModelParallelPlan:
    plan = deepseek_v3_parallel_plan(args)
    refusals = {
        "tensor_parallel": f"tensor parallel is {_LATER}",
        "pipeline_parallel": f"pipeline parallel is {_LATER}",
        "context_parallel": f"context parallel is {_LATER}",
    }
    blocks = tuple(f"vision_tower.encoder.blocks.{i}" for i in range(args.vision.depth))
    units = (*blocks, "vision_tower", "mm_projector")
    return dataclasses.replace(
        plan,
        document_mask=False,
        refusals=refusals,
        fsdp_units=units,
        context_parallel=None,  # the preflight names the refusal where there is no CP plan
    )
