"""The parallel-plan fragments every Llama-style decoder shares (docs/architecture.md, section 5;
docs/parallelisms.md): a family's ``parallel_plan.py`` assembles them and adds what is its own
(QK-norms, MoE blocks).

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
* QK-norms (optional) get the queries and keys as local tensors holding this rank's heads
  (dimension 2); ``SequenceParallel(sequence_dim=2)`` reads them as ``Shard(2)`` DTensors, so
  their weights become replicated DTensors whose gradients are reduced over ``tp``.

Attention derives its number of local heads from tensor shapes, so ``n_heads`` and
``n_kv_heads`` (and the SwiGLU width) must be divisible by the TP degree (``divisible``).
"""

from __future__ import annotations

from typing import Any

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
from torchtitan.distributed.pipeline_stages import PipelineUnit


def gather_sequence(n_inputs: int) -> PrepareModuleInput:
    """All-gather the sequence of a module's first input; the others (``freqs_cis``: a plain
    tensor) are left alone.

    The gathered input stays a replicated DTensor: the input projections' gradients (partial
    sums) then add up as DTensors and leave the module as one reduce-scatter onto the
    sequence shard. Handed on as a local tensor, each projection would all-reduce its own
    gradient in the backward (three all-reduces of the whole activation for q, k and v)."""
    rest = [None] * (n_inputs - 1)
    return PrepareModuleInput(
        input_layouts=(Shard(1), *rest),
        desired_input_layouts=(Replicate(), *rest),
        use_local_output=False,
    )


def _reduce_scatter() -> RowwiseParallel:
    return RowwiseParallel(output_layouts=Shard(1), use_local_output=False)


def root_plan() -> dict[str, ParallelStyle]:
    """The embedding (vocabulary-sharded, output on the sequence shard) and the final norm."""
    embedding = RowwiseParallel(
        input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
    )
    return {"tok_embeddings": embedding, "norm": SequenceParallel()}


def attention_plan(qk_norm: bool = False) -> dict[str, ParallelStyle]:
    """The attention sub-block: its norm, gathered input, q/k/v colwise, (QK-norms,) wo rowwise."""
    plan: dict[str, ParallelStyle] = {
        "attention_norm": SequenceParallel(),
        "attention": gather_sequence(2),  # (x, freqs_cis)
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
    }
    if qk_norm:
        for name in ("attention.q_norm", "attention.k_norm"):
            plan[name] = SequenceParallel(sequence_dim=2, use_local_output=True)
    plan["attention.wo"] = _reduce_scatter()
    return plan


def swiglu_plan() -> dict[str, ParallelStyle]:
    """The dense feed-forward sub-block: its norm, gathered input, w1/w3 colwise, w2 rowwise."""
    return {
        "ffn_norm": SequenceParallel(),
        "feed_forward": gather_sequence(1),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": _reduce_scatter(),
    }


def decoder_divisible(args: Any, ffn_name: str = "hidden_dim") -> dict[str, int]:
    """What the TP degree must divide: the heads and the SwiGLU width (named ``ffn_name``)."""
    return {"n_heads": args.n_heads, "n_kv_heads": args.kv_heads, ffn_name: args.hidden_dim}


def pipeline_units(args: Any) -> tuple[PipelineUnit, ...]:
    """Embedding, each block, and the head (the final norm and the output projection travel
    together; its unit is called ``norm`` in split points)."""
    blocks = [PipelineUnit(f"layers.{i}", (f"layers.{i}",)) for i in range(args.n_layers)]
    return (
        PipelineUnit("tok_embeddings", ("tok_embeddings",)),
        *blocks,
        PipelineUnit("norm", ("norm", "output")),
    )


def decoder_parallel_plan(
    args: Any, block: dict[str, ParallelStyle], divisible: dict[str, int]
) -> ModelParallelPlan:
    """The whole plan of a decoder on ``models/common/decoder.py``'s module names, given the
    family's TP block plan and its ``divisible`` sizes; context parallel swaps ``attention.core``."""
    tensor_parallel = TensorParallelPlan(
        root=root_plan(), block=block, output="output", divisible=divisible
    )
    return ModelParallelPlan(
        blocks="layers",
        pipeline_units=pipeline_units(args),
        tensor_parallel=tensor_parallel,
        embedding="tok_embeddings",
        context_parallel=ContextParallelPlan(
            attention_core="attention.core",
            kv_repeat=args.n_heads // args.kv_heads,
            rope_buffer="freqs_cis",
        ),
        tied_embeddings=args.tie_word_embeddings,
        document_mask=True,
    )
