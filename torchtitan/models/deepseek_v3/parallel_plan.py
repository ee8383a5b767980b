"""The DeepSeek-V3 parallel plan (docs/deepseek_v3.md; docs/parallelisms.md): the shared decoder
layout (``models/common/decoder_plan.py``) with MLA's tensor-parallel styles, dense and MoE
blocks in one block plan, and the MTP modules.

MLA under tensor parallel (``tp``):

* the residual stream enters attention still sequence-sharded (``Shard(1)``): the
  down-projections ``wq_a``/``wkv_a`` and the latent norms ``q_norm``/``kv_norm`` run on this
  rank's positions with replicated weights (``SequenceParallel``: no communication, no
  duplicated work; their gradients are reduced over ``tp``);
* the up-projections ``wq_b`` (or ``wq``) and ``wkv_b`` are column-sharded by heads and
  all-gather their input: the latents (``q_lora_rank``, ``kv_lora_rank`` wide), much narrower
  than the residual stream a Llama-style plan gathers; the rotated key (``qk_rope_head_dim``,
  shared by all heads) is all-gathered at ``attention.rope_key``;
* ``wo`` is row-sharded and reduce-scatters back onto the sequence shard.

Dense blocks hold ``feed_forward`` (the SwiGLU, split like Llama's), MoE blocks ``moe``, which
runs whole on every TP rank (``ReplicateParallel``; experts split by expert parallel instead):
each style applies where its module exists. The MTP modules get the same block styles under
``mtp.<k>.block`` plus sequence-parallel norms and projection (root styles).

Pipeline parallel: the MTP modules travel with the final norm and the output head (the unit
``norm``). Their input embeddings come from the first stage, which holds the embedding: it sends
them behind the hidden states (``Transformer.forward``; docs/deepseek_v3.md).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
)

from torchtitan.distributed.model_plan import (
    ContextParallelPlan,
    ModelParallelPlan,
    TensorParallelPlan,
)
from torchtitan.distributed.pipeline_stages import PipelineUnit
from torchtitan.distributed.replicate_parallel import ReplicateParallel
from torchtitan.models.common.decoder_plan import root_plan, swiglu_plan
from torchtitan.models.deepseek_v3.args import DeepSeekV3Args


class GatherSharedInput(ParallelStyle):
    """All-gather the sequence of a module's input (a ``Shard(1)`` DTensor) into a plain tensor
    that every head of every TP rank uses: its gradient is each rank's partial sum
    (``Partial``), reduce-scattered back onto the sequence shard. (``PrepareModuleInput`` would
    call it replicated and drop the other ranks' heads' share: MLA's rotated key.)"""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def gather(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            x = args[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, [Shard(1)], run_check=False)
            full = x.redistribute(device_mesh, [Replicate()])
            return (full.to_local(grad_placements=[Partial()]), *args[1:])

        module.register_forward_pre_hook(gather)
        return module


def mla_plan() -> dict[str, ParallelStyle]:
    gathered = ColwiseParallel(input_layouts=Shard(1))  # all-gather the latent, split heads
    return {
        "attention_norm": SequenceParallel(),
        "attention.wq": gathered,
        "attention.wq_a": SequenceParallel(),
        "attention.q_norm": SequenceParallel(),
        "attention.wq_b": gathered,
        "attention.wkv_a": SequenceParallel(),
        "attention.kv_norm": SequenceParallel(),
        "attention.wkv_b": gathered,
        "attention.rope_key": GatherSharedInput(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }


def block_plan() -> dict[str, ParallelStyle]:
    """MLA, then the dense SwiGLU or the whole MoE layer (whichever the block has)."""
    return {**mla_plan(), **swiglu_plan(), "moe": ReplicateParallel(sequence_dim=1)}


def deepseek_v3_parallel_plan(args: DeepSeekV3Args) -> ModelParallelPlan:
    root = root_plan()
    for k in range(args.mtp_depth):
        p = f"mtp.{k}."
        for name in ("enorm", "hnorm", "eh_proj", "norm"):
            root[p + name] = SequenceParallel()
        root.update({f"{p}block.{name}": style for name, style in block_plan().items()})
    divisible = {"n_heads": args.n_heads, "intermediate_size": args.intermediate_size}
    blocks = [PipelineUnit(f"layers.{i}", (f"layers.{i}",)) for i in range(args.n_layers)]
    head = ("norm", "output", "mtp") if args.mtp_depth else ("norm", "output")
    return ModelParallelPlan(
        blocks="layers",
        pipeline_units=(
            PipelineUnit("tok_embeddings", ("tok_embeddings",)),
            *blocks,
            PipelineUnit("norm", head),
        ),
        tensor_parallel=TensorParallelPlan(
            root=root, block=block_plan(), output="output", divisible=divisible
        ),
        embedding="tok_embeddings",
        # K/V are per head after the up-projection: nothing to repeat.
        context_parallel=ContextParallelPlan(
            attention_core="attention.core", kv_repeat=1, rope_buffer="freqs_cis"
        ),
        tied_embeddings=args.tie_word_embeddings,
        document_mask=True,
    )
