"""The parallel plan of Qwen3.5 with vision (docs/vlm.md, "Parallelism").

The decoder keeps Qwen3.5's plan (``models/qwen3_5/parallel_plan.py``: tensor, sequence and
loss parallel, its FSDP units). The vision tower is data-parallel work: each rank encodes the
images of its own samples.

* Tensor parallel: the tower runs whole on every TP rank (the ranks of one TP group hold the
  same samples, so they encode the same images); its parameters are replicated DTensors on
  ``tp`` computed with their local values (``ReplicateWeights``), so every TP rank computes the
  same tower gradients and the same updates, with no collective. The token embedding returns
  whole rows (vocabulary-sharded lookup, all-reduced rather than reduce-scattered), the image
  tokens are scattered into them (``model.scatter``), and the scatter's output is cut onto the
  sequence shard the first block expects (``Shard(1)``).
* FSDP: each tower block is its own unit, then the tower's remaining parameters (patch
  embedding, position table, merger); activation checkpointing and compile wrap each tower
  block as they do the decoder's (``extra_blocks``).
* Pipeline parallel: the tower and the scatter travel with the token embedding (the first
  stage's ``tok_embeddings`` unit); the image inputs come per sample (``images.py``) so the
  schedule's microbatches split them with their samples, and ``mrope_positions`` reaches every
  stage as a keyword input.
* Context parallel: Qwen3.5's (DeltaNet and attention on the rank's share of the sequence);
  every cp rank runs the tower on the whole batch's images (``pixel_values`` and ``grid_thw``
  are whole inputs, not sharded along the sequence), and each placeholder of its share takes
  its token by ``visual_index``.
"""

from __future__ import annotations

import dataclasses

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, PrepareModuleOutput, RowwiseParallel

from torchtitan.distributed.model_plan import ModelParallelPlan
from torchtitan.distributed.pipeline_stages import PipelineUnit
from torchtitan.distributed.replicate_parallel import ReplicateWeights
from torchtitan.models.qwen3_5.parallel_plan import qwen35_parallel_plan
from torchtitan.models.qwen3_5_vl.args import Qwen35VLArgs

WHOLE_INPUTS = ("pixel_values", "grid_thw")
"""Per-sample keyword inputs every cp rank receives whole (images are not along the sequence)."""


def vision_root_plan() -> dict[str, ParallelStyle]:
    """The root entries that differ from the decoder's: whole embedding rows, the scatter's
    output onto the sequence shard, the tower replicated."""
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "scatter": PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=False
        ),
        "visual": ReplicateWeights(),
    }


def qwen35_vl_parallel_plan(args: Qwen35VLArgs) -> ModelParallelPlan:
    plan = qwen35_parallel_plan(args)
    tp = plan.tensor_parallel
    tp = dataclasses.replace(tp, root={**tp.root, **vision_root_plan()})
    blocks = tuple(f"visual.blocks.{i}" for i in range(args.vision.depth))
    first, *rest = plan.pipeline_units
    assert first.modules == ("tok_embeddings",), first
    units = (PipelineUnit(first.name, ("tok_embeddings", "visual", "scatter")), *rest)
    cp = plan.context_parallel
    if cp is not None:
        cp = dataclasses.replace(cp, whole_inputs=WHOLE_INPUTS)
    return dataclasses.replace(
        plan,
        tensor_parallel=tp,
        document_mask=False,
        fsdp_units=(*blocks, "visual"),
        extra_blocks=("visual.blocks",),
        pipeline_units=units,
        context_parallel=cp,
    )
