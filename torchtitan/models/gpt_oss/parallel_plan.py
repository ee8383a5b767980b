"""The GPT-OSS parallel plan: the shared decoder layout (``models/common/decoder_plan.py``;
docs/parallelisms.md) with GPT-OSS's attention and its all-MoE blocks (docs/gpt_oss.md).

* Tensor parallel splits the heads: ``wq``/``wk``/``wv`` column-wise (weights and biases),
  ``wo`` row-wise (its bias replicated), and the attention sinks, one per query head, sharded
  with their heads (:class:`ShardHeads` on ``attention.core``). The MoE blocks run whole on every
  TP rank (``ReplicateParallel``; the experts are split by expert parallel instead).
* Context parallel is not offered (``context_parallel=None``: preflight refuses
  ``context_parallel_degree > 1`` for this family): the shared CP cores compute plain softmax
  attention and would drop the sinks and the sliding window.
"""

from __future__ import annotations

import dataclasses

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel

from torchtitan.distributed.model_plan import ModelParallelPlan
from torchtitan.distributed.replicate_parallel import ReplicateParallel
from torchtitan.models.common.decoder_plan import (
    attention_plan,
    decoder_divisible,
    decoder_parallel_plan,
)
from torchtitan.models.gpt_oss.args import GptOssArgs


class ShardHeads(ParallelStyle):
    """Every direct parameter of the module (the sinks, ``[n_heads]``) becomes a ``Shard(0)``
    DTensor on ``tp``: rank ``r`` holds the entries of the query heads its column-sharded ``wq``
    computes. The module reads the local shard (``DTensor.to_local``); no communication."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, p in list(module.named_parameters(recurse=False)):
            if not isinstance(p, DTensor):
                sharded = distribute_tensor(p.data, device_mesh, [Shard(0)])
                module.register_parameter(name, nn.Parameter(sharded, p.requires_grad))
        return module


def gpt_oss_parallel_plan(args: GptOssArgs) -> ModelParallelPlan:
    block: dict[str, ParallelStyle] = {
        **attention_plan(),
        "attention.core": ShardHeads(),
        "ffn_norm": SequenceParallel(),
        "feed_forward": ReplicateParallel(sequence_dim=1),
    }
    sizes = decoder_divisible(args)
    del sizes["hidden_dim"]  # the experts are not split by tensor parallel
    plan = decoder_parallel_plan(args, block, sizes)
    return dataclasses.replace(plan, context_parallel=None)
