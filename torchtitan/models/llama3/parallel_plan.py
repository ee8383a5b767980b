"""The Llama 3 parallel plan: what tensor, context and pipeline parallelism, activation
checkpointing, compile and FSDP need to know about this architecture. The generic layers in
``distributed/`` apply it in a fixed order (docs/architecture.md, section 5).

Tensor parallel layout of one block on the ``tp`` mesh (``S`` is the sequence dimension):

* The residual stream between blocks is a DTensor sharded on the sequence, ``Shard(1)``:
  each rank holds ``S / tp`` positions. Keeping it a DTensor (``use_local_output=False``)
  keeps ``h.shape`` global, so the model's RoPE slice ``freqs_cis[:seqlen]`` stays right.
* RMSNorms run on the sequence shard (``SequenceParallel``): no communication, and their
  weights become replicated DTensors, so every parameter of the model is a DTensor
  (foreach/fused optimizers and norm kernels refuse a mix of Tensor and DTensor).
* Attention and feed-forward all-gather the sequence on entry (``PrepareModuleInput``
  Shard(1) -> Replicate), run column-sharded input projections (``wq wk wv w1 w3``: heads and
  hidden units split over ranks, no communication) and a row-sharded output projection
  (``wo w2``) whose partial sums are reduce-scattered back onto the sequence shard.
* The embedding is row-sharded over the vocabulary (each rank looks up its vocabulary slice,
  the partial results are reduce-scattered onto the sequence shard); the output projection is
  column-sharded over the vocabulary (``TensorParallelPlan.output``).

Attention derives its number of local heads from tensor shapes, so ``n_heads`` and
``n_kv_heads`` (and the SwiGLU width) must be divisible by the TP degree.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
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
from torchtitan.models.llama3.args import ModelArgs


def _tensor_parallel_plan(args: ModelArgs) -> TensorParallelPlan:
    root = {
        "tok_embeddings": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
        ),
        "norm": SequenceParallel(),
    }
    block = {
        "attention_norm": SequenceParallel(),
        # (x, freqs_cis): gather the sequence of x; freqs_cis is a plain tensor, left alone.
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None),
            desired_input_layouts=(Replicate(), None),
            use_local_output=True,
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Replicate(),),
            use_local_output=True,
        ),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }
    sizes = {"n_heads": args.n_heads, "n_kv_heads": args.kv_heads, "hidden_dim": args.hidden_dim}
    return TensorParallelPlan(root=root, block=block, output="output", divisible=sizes)


def pipeline_units(args: ModelArgs) -> tuple[PipelineUnit, ...]:
    """Embedding, each block, and the head (the final norm and the output projection travel
    together; its unit is called ``norm`` in split points)."""
    blocks = [PipelineUnit(f"layers.{i}", (f"layers.{i}",)) for i in range(args.n_layers)]
    return (
        PipelineUnit("tok_embeddings", ("tok_embeddings",)),
        *blocks,
        PipelineUnit("norm", ("norm", "output")),
    )


def llama3_parallel_plan(args: ModelArgs) -> ModelParallelPlan:
    return ModelParallelPlan(
        blocks="layers",
        pipeline_units=pipeline_units(args),
        tensor_parallel=_tensor_parallel_plan(args),
        embedding="tok_embeddings",
        context_parallel=ContextParallelPlan(
            attention_core="attention.core",
            kv_repeat=args.n_heads // args.kv_heads,
            rope_buffer="freqs_cis",
        ),
        tied_embeddings=args.tie_word_embeddings,
        document_mask=True,
    )
