"""The Qwen3 parallel plan: the shared decoder layout (``models/common/decoder_plan.py``;
docs/parallelisms.md) plus the per-head QK-norms, and for MoE flavors the MoE blocks.

MoE blocks run whole on every TP rank (``ReplicateParallel``: the sequence gathered, every
weight a replicated DTensor; the experts are split by expert parallel instead). A flavor mixing
dense and MoE blocks has no layout (one block plan holds one of them): ``divisible`` then holds a
size of 1 named after the reason, so any TP degree above 1 is refused by config validation with
that name (``tp_problem``).
"""

from __future__ import annotations

import dataclasses

from torch.distributed.tensor.parallel import ParallelStyle

from torchtitan.distributed.model_plan import ModelParallelPlan
from torchtitan.distributed.replicate_parallel import ReplicateParallel
from torchtitan.models.common.decoder_plan import (
    attention_plan,
    decoder_divisible,
    decoder_parallel_plan,
    swiglu_plan,
)
from torchtitan.models.qwen3.args import Qwen3Args

MOE_NO_TP = "moe_blocks_have_no_tp_layout"


def qwen3_parallel_plan(args: Qwen3Args) -> ModelParallelPlan:
    ffn: dict[str, ParallelStyle] = swiglu_plan()
    sizes = decoder_divisible(args, ffn_name="intermediate_size")
    if args.moe is not None and args.moe_layers is None:
        # Every block is MoE: it runs whole on each TP rank (experts split by EP instead).
        ffn = {"ffn_norm": ffn["ffn_norm"], "feed_forward": ReplicateParallel(sequence_dim=1)}
        del sizes["intermediate_size"]
    elif args.moe is not None:
        sizes[MOE_NO_TP] = 1  # dense and MoE blocks mixed: one block plan cannot hold both
    block = {**attention_plan(qk_norm=True), **ffn}
    plan = decoder_parallel_plan(args, block, sizes)
    if args.sliding_window is not None:
        # The shared CP cores compute full causal attention: a windowed model offers no CP.
        plan = dataclasses.replace(plan, context_parallel=None)
    return plan
