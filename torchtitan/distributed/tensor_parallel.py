"""Tensor parallel (Megatron-style) with sequence parallel and loss parallel, via DTensor.

Layout of one transformer block on the ``tp`` mesh (``S`` is the sequence dimension):

* The residual stream between blocks is a DTensor sharded on the sequence, ``Shard(1)``:
  each rank holds ``S / tp`` positions. Keeping it a DTensor (``use_local_output=False``)
  keeps ``h.shape`` global, so the model's RoPE slice ``freqs_cis[:seqlen]`` stays right.
* RMSNorms run on the sequence shard (``SequenceParallel``): no communication, and their
  weights become replicated DTensors, so every parameter of the model is a DTensor
  (torch 2.13's foreach/fused optimizers and norm kernels refuse a mix of Tensor and DTensor).
* Attention and feed-forward all-gather the sequence on entry (``PrepareModuleInput``
  Shard(1) -> Replicate), run column-sharded input projections (``wq wk wv w1 w3``: heads and
  hidden units split over ranks, no communication) and a row-sharded output projection
  (``wo w2``) whose partial sums are reduce-scattered back onto the sequence shard.
* The embedding is row-sharded over the vocabulary (each rank looks up its vocabulary slice,
  the partial results are reduce-scattered onto the sequence shard).
* The output projection is column-sharded over the vocabulary. With loss parallel the logits
  stay sharded ``Shard(-1)`` and cross-entropy runs on the shards inside
  ``torch.distributed.tensor.parallel.loss_parallel()`` (the trainer's train context);
  otherwise they are all-gathered to a plain tensor.

Attention derives its number of local heads from tensor shapes, so ``n_heads`` and
``n_kv_heads`` must be divisible by the TP degree (checked in config validation).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from torchtitan.tools.logging import logger


def _block_plan() -> dict[str, object]:
    return {
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


def apply_tp(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    loss_parallel: bool,
    enable_async_tp: bool = False,
) -> None:
    """Shard ``model`` (a Llama 3 ``Transformer``) over the 1-D ``tp_mesh`` in place.

    ``loss_parallel``: keep the logits sharded over the vocabulary for a parallel cross-entropy
    (the caller must compute the loss inside ``loss_parallel()``); else gather them.
    ``enable_async_tp``: overlap the TP collectives with the matmuls (CUDA + torch.compile;
    see ``enable_async_tensor_parallel``).
    """
    top: dict[str, object] = {}
    if getattr(model, "tok_embeddings", None) is not None:
        top["tok_embeddings"] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
        )
    if getattr(model, "norm", None) is not None:
        top["norm"] = SequenceParallel()
    if getattr(model, "output", None) is not None:
        top["output"] = ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    parallelize_module(model, tp_mesh, top)  # type: ignore[arg-type]
    layers = getattr(model, "layers", None)
    for block in layers.values() if layers is not None else ():
        parallelize_module(block, tp_mesh, _block_plan())  # type: ignore[arg-type]
    if enable_async_tp:
        enable_async_tensor_parallel(tp_mesh)
    logger.info(
        f"tensor parallel {tp_mesh.size()}: sequence parallel norms, "
        f"loss parallel {'on' if loss_parallel else 'off'}, async {'on' if enable_async_tp else 'off'}"
    )


def enable_async_tensor_parallel(tp_mesh: DeviceMesh) -> None:
    """Let inductor fuse TP collectives with the neighbouring matmuls (micro-pipelining).

    Needs CUDA (symmetric memory for the TP group) and torch.compile of the blocks; config
    validation rejects it elsewhere, this assert only guards direct callers.
    """
    assert tp_mesh.device_type == "cuda", "async tensor parallel needs CUDA"
    import torch._inductor.config as inductor_config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    inductor_config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)
