"""The Qwen3.5 parallel plan (docs/qwen3_5.md, docs/parallelisms.md).

Tensor parallel shards heads in both kinds of layer; one block plan holds both (a style whose
module a block lacks is skipped):

* gated attention: the shared layout (``models/common/decoder_plan.py``); ``wq``'s rows are
  whole heads (query and gate together), so its column shard keeps each head's gate;
* Gated DeltaNet: the sequence gathered on entry, ``wqkv`` (rows grouped by key head), ``wz``,
  ``wb``, ``wa`` column-sharded, the convolution channels and ``A_log``/``dt_bias`` sharded on
  dimension 0 the same way (:class:`GatherShardHeads`), so each rank runs the recurrence of its
  own heads with no communication; the per-head output norm as the QK-norms; ``wo`` row-sharded
  and reduce-scattered onto the sequence shard;
* MoE blocks run whole on each TP rank (``ReplicateParallel``; experts split by EP), as Qwen3's.

Context parallel is refused (``context_parallel=None``): a DeltaNet layer's state would have to
pass from rank to rank along the sequence.
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
)

from torchtitan.distributed.model_plan import ModelParallelPlan
from torchtitan.distributed.replicate_parallel import ReplicateParallel
from torchtitan.models.common.decoder_plan import (
    attention_plan,
    decoder_divisible,
    decoder_parallel_plan,
    gather_sequence,
    swiglu_plan,
)
from torchtitan.models.qwen3_5.args import Qwen35Args

HEAD_PARAMS = ("conv", "A_log", "dt_bias")
"""The DeltaNet's own parameters with one row per channel or head."""


class GatherShardHeads(ParallelStyle):
    """The DeltaNet module: its per-head parameters (:data:`HEAD_PARAMS`) sharded on dimension
    0 over ``tp`` (the same heads as the column-sharded projections), its input gathered."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name in HEAD_PARAMS:
            p = getattr(module, name)
            if not isinstance(p, DTensor):
                sharded = distribute_tensor(p.data, device_mesh, [Shard(0)])
                module.register_parameter(name, nn.Parameter(sharded, p.requires_grad))
        return gather_sequence(2)._apply(module, device_mesh)


def deltanet_plan() -> dict[str, ParallelStyle]:
    plan: dict[str, ParallelStyle] = {"linear_attn": GatherShardHeads()}
    for name in ("wqkv", "wz", "wb", "wa"):
        plan[f"linear_attn.{name}"] = ColwiseParallel()
    plan["linear_attn.norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    plan["linear_attn.wo"] = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
    return plan


def qwen35_parallel_plan(args: Qwen35Args) -> ModelParallelPlan:
    ffn: dict[str, ParallelStyle] = swiglu_plan()
    sizes = decoder_divisible(args, ffn_name="intermediate_size")
    if args.moe is not None:
        ffn = {"ffn_norm": ffn["ffn_norm"], "feed_forward": ReplicateParallel(sequence_dim=1)}
        del sizes["intermediate_size"]
    sizes["linear_num_key_heads"] = args.linear_num_key_heads
    sizes["linear_num_value_heads"] = args.linear_num_value_heads
    block = {**attention_plan(qk_norm=True), **deltanet_plan(), **ffn}
    return replace(decoder_parallel_plan(args, block, sizes), context_parallel=None)
