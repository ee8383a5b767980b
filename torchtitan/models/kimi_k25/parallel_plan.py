"""The parallel plan of Kimi K2.5 (docs/vlm.md, "Kimi K2.5"): the decoder's as DeepSeek-V3's
(``models/deepseek_v3/parallel_plan.py``); the MoonViT tower and projector are data-parallel work
(each rank encodes the images of its own samples).

* FSDP: each tower block is its own unit, then the tower's remaining parameters (patch
  embedding, position table, final norm), then the projector; activation checkpointing and
  compile wrap each tower block as they do the decoder's (``extra_blocks``).
* Tensor parallel: the tower and projector run whole on every TP rank (the ranks of one TP
  group hold the same samples), their parameters replicated DTensors computed with their local
  values (``ReplicateWeights``); the token embedding returns whole rows, the image tokens are
  scattered into them (``model.scatter``) and the scatter's output is cut onto the sequence
  shard the first block expects (``Shard(1)``), as for qwen3_5_vl.

* Pipeline parallel: the tower, the projector and the scatter travel with the token embedding
  (the first stage's ``tok_embeddings`` unit); the image inputs come per sample
  (``models/common/vision/images.py``), so the schedule's microbatches split them with their
  samples. Later stages need nothing of the images: the decoder's positions are plain 1-D.
* Context parallel: DeepSeek-V3's (MLA on the rank's share of the sequence, the RoPE buffer
  sharded alike); every cp rank runs the tower on the whole batch's images (``pixel_values``
  and ``grid_thw`` are whole inputs, not sharded along the sequence), and each placeholder of
  its share takes its token by ``visual_index``.
"""

from __future__ import annotations

import dataclasses

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, PrepareModuleOutput, RowwiseParallel

from torchtitan.distributed.model_plan import ModelParallelPlan
from torchtitan.distributed.pipeline_stages import PipelineUnit
from torchtitan.distributed.replicate_parallel import ReplicateWeights
from torchtitan.models.deepseek_v3.parallel_plan import deepseek_v3_parallel_plan
from torchtitan.models.kimi_k25.args import KimiK25Args

WHOLE_INPUTS = ("pixel_values", "grid_thw")
"""Per-sample keyword inputs every cp rank receives whole (images are not along the sequence)."""


def vision_root_plan() -> dict[str, ParallelStyle]:
    """The root entries that differ from the decoder's: whole embedding rows, the scatter's
    output onto the sequence shard, the tower and projector replicated."""
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "scatter": PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=False
        ),
        "vision_tower": ReplicateWeights(),
        "mm_projector": ReplicateWeights(),
    }


def kimi_k25_parallel_plan(args: KimiK25Args) -> ModelParallelPlan:
    plan = deepseek_v3_parallel_plan(args)
    tp = plan.tensor_parallel
    tp = dataclasses.replace(tp, root={**tp.root, **vision_root_plan()})
    blocks = tuple(f"vision_tower.encoder.blocks.{i}" for i in range(args.vision.depth))
    first, *rest = plan.pipeline_units
    assert first.modules == ("tok_embeddings",), first
    visual = ("tok_embeddings", "vision_tower", "mm_projector", "scatter")
    cp = plan.context_parallel
    if cp is not None:
        cp = dataclasses.replace(cp, whole_inputs=WHOLE_INPUTS)
    return dataclasses.replace(
        plan,
        tensor_parallel=tp,
        document_mask=False,
        fsdp_units=(*blocks, "vision_tower", "mm_projector"),
        extra_blocks=("vision_tower.encoder.blocks",),
        pipeline_units=(PipelineUnit(first.name, visual), *rest),
        context_parallel=cp,
    )
