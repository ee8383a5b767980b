"""The Qwen3 parallel plan: Llama 3's layout (``llama3/parallel_plan.py``; docs/parallelisms.md)
plus the per-head QK-norms.

Under tensor parallel the queries and keys reach the QK-norms as local tensors holding this
rank's heads (dimension 2). ``SequenceParallel(sequence_dim=2)`` reads them as ``Shard(2)``
DTensors, so the norm weights become replicated DTensors like every other parameter and their
gradients (partial over the heads) are reduced over ``tp``.

MoE blocks run whole on every TP rank (``ReplicateParallel``: the sequence gathered, every
weight a replicated DTensor; the experts are split by expert parallel instead). A flavor mixing
dense and MoE blocks has no layout (one block plan holds one of them): ``divisible`` then holds a
size of 1 named after the reason, so any TP degree above 1 is refused by config validation with
that name (``tp_problem``).
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from torchtitan.distributed.model_plan import (
    ContextParallelPlan,
    ModelParallelPlan,
    TensorParallelPlan,
)
from torchtitan.distributed.pipeline_plan import PipelineUnit
from torchtitan.distributed.replicate_parallel import ReplicateParallel
from torchtitan.models.qwen3.args import Qwen3Args

MOE_NO_TP = "moe_blocks_have_no_tp_layout"


def _gather(n_inputs: int) -> PrepareModuleInput:
    return PrepareModuleInput(
        input_layouts=(Shard(1), *([None] * (n_inputs - 1))),
        desired_input_layouts=(Replicate(), *([None] * (n_inputs - 1))),
        use_local_output=True,
    )


def _tensor_parallel_plan(args: Qwen3Args) -> TensorParallelPlan:
    root: dict[str, ParallelStyle] = {
        "tok_embeddings": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
        ),
        "norm": SequenceParallel(),
    }
    block: dict[str, ParallelStyle] = {
        "attention_norm": SequenceParallel(),
        "attention": _gather(2),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "attention.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "ffn_norm": SequenceParallel(),
        "feed_forward": _gather(1),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }
    sizes = {
        "n_heads": args.n_heads,
        "n_kv_heads": args.n_kv_heads,
        "intermediate_size": args.intermediate_size,
    }
    if args.moe is not None and args.moe_layers is None:
        # Every block is MoE: it runs whole on each TP rank (experts split by EP instead).
        block = {k: v for k, v in block.items() if not k.startswith("feed_forward")}
        block["feed_forward"] = ReplicateParallel(sequence_dim=1)
        del sizes["intermediate_size"]
    elif args.moe is not None:
        sizes[MOE_NO_TP] = 1  # dense and MoE blocks mixed: one block plan cannot hold both
    return TensorParallelPlan(root=root, block=block, output="output", divisible=sizes)


def pipeline_units(args: Qwen3Args) -> tuple[PipelineUnit, ...]:
    blocks = [PipelineUnit(f"layers.{i}", (f"layers.{i}",)) for i in range(args.n_layers)]
    return (
        PipelineUnit("tok_embeddings", ("tok_embeddings",)),
        *blocks,
        PipelineUnit("norm", ("norm", "output")),
    )


def qwen3_parallel_plan(args: Qwen3Args) -> ModelParallelPlan:
    return ModelParallelPlan(
        blocks="layers",
        pipeline_units=pipeline_units(args),
        tensor_parallel=_tensor_parallel_plan(args),
        embedding="tok_embeddings",
        context_parallel=ContextParallelPlan(
            attention_core="attention.core",
            kv_repeat=args.n_heads // args.n_kv_heads,
            rope_buffer="freqs_cis",
        ),
        tied_embeddings=args.tie_word_embeddings,
        document_mask=True,
    )
