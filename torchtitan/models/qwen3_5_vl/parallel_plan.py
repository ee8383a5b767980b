"""The parallel plan of Qwen3.5 with vision (docs/vlm.md, "Parallelism"): the decoder's FSDP
units as Qwen3.5's (``models/qwen3_5/parallel_plan.py``); the vision tower is data-parallel
work (each rank encodes its own images) with its own FSDP units: each tower block, then the
tower's remaining parameters (patch embedding, position table, merger).

Pipeline parallel: the tower travels with the token embedding (the first stage's
``tok_embeddings`` unit), which scatters its tokens into the embeddings; the image inputs come
per sample (``images.py``) so the schedule's microbatches split them with their samples, and
``mrope_positions`` reaches every stage as a keyword input. Context parallel: Qwen3.5's
(DeltaNet and attention on the rank's share of the sequence); every cp rank runs the tower on
the whole batch's images (``pixel_values`` and ``grid_thw`` are whole inputs, not sharded along
the sequence), and each placeholder of its share takes its token by ``visual_index``. Tensor
parallel is refused for now (one line at config validation)."""

from __future__ import annotations

import dataclasses

from torchtitan.distributed.model_plan import ModelParallelPlan
from torchtitan.distributed.pipeline_stages import PipelineUnit
from torchtitan.models.qwen3_5.parallel_plan import qwen35_parallel_plan
from torchtitan.models.qwen3_5_vl.args import Qwen35VLArgs

_LATER = "not implemented yet for qwen3_5_vl (docs/vlm.md); use data parallel (FSDP)"
WHOLE_INPUTS = ("pixel_values", "grid_thw")
"""Per-sample keyword inputs every cp rank receives whole (images are not along the sequence)."""


def qwen35_vl_parallel_plan(args: Qwen35VLArgs) -> ModelParallelPlan:
    plan = qwen35_parallel_plan(args)
    refusals = {**plan.refusals, "tensor_parallel": f"tensor parallel is {_LATER}"}
    tower = tuple(f"visual.blocks.{i}" for i in range(args.vision.depth)) + ("visual",)
    first, *rest = plan.pipeline_units
    assert first.modules == ("tok_embeddings",), first
    units = (PipelineUnit(first.name, ("tok_embeddings", "visual")), *rest)
    cp = plan.context_parallel
    if cp is not None:
        cp = dataclasses.replace(cp, whole_inputs=WHOLE_INPUTS)
    return dataclasses.replace(
        plan,
        document_mask=False,
        refusals=refusals,
        fsdp_units=tower,
        pipeline_units=units,
        context_parallel=cp,
    )
