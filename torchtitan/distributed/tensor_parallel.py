"""Tensor parallel (Megatron-style) with sequence parallel and loss parallel, via DTensor.

The model's plan (``TensorParallelPlan``, from its family folder) says which module gets which
``ParallelStyle``; this module applies it. The vocabulary projection named by
``plan.output`` is column-sharded over the vocabulary: with loss parallel the logits stay
sharded ``Shard(-1)`` and cross-entropy runs on the shards inside
``torch.distributed.tensor.parallel.loss_parallel()`` (the trainer's train context);
otherwise they are all-gathered to a plain tensor. The residual stream enters it sharded on
the sequence (``Shard(1)``, sequence parallel).
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, parallelize_module

from torchtitan.distributed.model_plan import TensorParallelPlan, submodule_or_none
from torchtitan.tools.logging import logger


def tp_problem(divisible: Mapping[str, int], tp: int, seq_len: int | None = None) -> str | None:
    """Why ``tp`` cannot split a model with these sizes (and this sequence length, when given)
    over its ranks, or None if it can: every size in ``divisible`` and the sequence (sequence
    parallel) must divide by it. Config validation and the planner both ask this."""
    for name, size in divisible.items():
        if size % tp != 0:
            shown = ", ".join(f"{k}={v}" for k, v in divisible.items())
            return (
                f"{name}={size}, which tensor parallel cannot split over {tp} ranks ({shown} "
                "must all be divisible by it)"
            )
    if seq_len is not None and seq_len % tp != 0:
        return f"seq_len={seq_len}, which sequence parallel cannot split over {tp} ranks"
    return None


def _present(model: nn.Module, styles: Mapping[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """The styles of the modules present; a module with ``adapt_parallel_style`` (an adapter
    wrapper, docs/lora.md) turns its style into one that also places its own parameters."""
    out: dict[str, ParallelStyle] = {}
    for k, v in styles.items():
        sub = submodule_or_none(model, k)
        if sub is not None:
            adapt = getattr(sub, "adapt_parallel_style", None)
            out[k] = adapt(v) if callable(adapt) else v
    return out


def apply_tp(
    model: nn.Module,
    blocks: nn.ModuleDict,
    tp_mesh: DeviceMesh,
    plan: TensorParallelPlan,
    loss_parallel: bool,
    enable_async_tp: bool = False,
    output_deferred: bool = False,
) -> None:
    """Shard ``model`` (a whole model or a pipeline stage of one) over the 1-D ``tp_mesh``.

    ``blocks``: the model's blocks, each parallelized with ``plan.block``.
    ``loss_parallel``: keep the logits sharded over the vocabulary for a parallel cross-entropy
    (the caller must compute the loss inside ``loss_parallel()``); else gather them.
    ``enable_async_tp``: overlap the TP collectives with the matmuls (CUDA + torch.compile;
    see ``enable_async_tensor_parallel``).
    ``output_deferred``: the output projection is a ``DeferredLinear`` (chunked loss): its
    weight is still sharded over the vocabulary, its forward returns the gathered hidden states.
    """
    root = dict(plan.root)
    residual = Shard(1) if plan.sequence_parallel else Replicate()
    if plan.output is not None and output_deferred:
        root[plan.output] = ColwiseParallel(
            input_layouts=residual, output_layouts=Replicate(), use_local_output=False
        )
    elif plan.output is not None:
        root[plan.output] = ColwiseParallel(
            input_layouts=residual,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    parallelize_module(model, tp_mesh, _present(model, root))  # type: ignore[arg-type]
    for block in blocks.values():
        parallelize_module(block, tp_mesh, _present(block, plan.block))  # type: ignore[arg-type]
    if enable_async_tp:
        enable_async_tensor_parallel(tp_mesh)
    logger.info(
        f"tensor parallel {tp_mesh.size()}: sequence parallel "
        f"{'norms' if plan.sequence_parallel else 'off'}, "
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
