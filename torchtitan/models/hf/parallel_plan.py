"""The ``hf`` family's parallel plan, found on the built model (docs/hf_models.md).

* Blocks: the decoder layers (``model.decoder_layers_path``: the ``nn.ModuleList`` of the class
  transformers names in ``_no_split_modules``), each an FSDP, activation-checkpointing and
  compile unit.
* Tensor parallel: transformers' own ``base_model_tp_plan`` (``layers.*.<module>: <style>``)
  translated into torch ``ParallelStyle``s. The residual stream stays replicated (no sequence
  parallel): transformers' decoder code runs unchanged between the sharded projections. Every
  other parameter (embedding, norms, routers) becomes a replicated DTensor on ``tp`` (a mix of
  Tensors and DTensors is refused by foreach optimizers), its module fed replicated inputs.
  A model without a TP plan, or one naming a style we do not translate, refuses TP with why.
* Pipeline and context parallel are refused: transformers' forward is one function over all
  layers (masks and rotary tables are made once at its root) and its attention is no
  swappable core on ``[B, H, S, Dh]``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
)

from torchtitan.distributed.model_plan import ModelParallelPlan, TensorParallelPlan
from torchtitan.distributed.pipeline_stages import PipelineUnit
from torchtitan.models.hf.args import HFArgs
from torchtitan.models.hf.model import decoder_layers_path, meta_model

PIPELINE_REFUSAL = (
    "transformers runs its decoder as one forward over all layers (the attention mask and "
    "rotary table are made once at its root), which cannot be cut into stages generically"
)
CP_REFUSAL = (
    "transformers' attention modules have no swappable attention core that could run on a "
    "sharded sequence"
)


class ReplicateParallel(ParallelStyle):
    """Parameters replicated on the TP mesh (DTensors), inputs read as replicated, outputs
    handed on as local tensors: for modules that run on the replicated residual stream.
    Styles sharing ``memo`` give a parameter shared by two modules (a tied embedding and
    head) one DTensor."""

    def __init__(self, memo: dict[int, tuple[nn.Parameter, nn.Parameter]] | None = None) -> None:
        super().__init__()
        self.memo = {} if memo is None else memo

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for key, p in list(mod.named_parameters(recurse=False)):
                if isinstance(p, DTensor):
                    continue
                if id(p) not in self.memo:  # the old one is kept: its id stays unique
                    dist = distribute_tensor(p, mesh, [Replicate()])
                    self.memo[id(p)] = (p, nn.Parameter(dist, p.requires_grad))
                mod.register_parameter(key, self.memo[id(p)][1])

        def inputs(mod: nn.Module, args: Any, mesh: DeviceMesh) -> Any:
            return tuple(
                DTensor.from_local(a, mesh, [Replicate()], run_check=False)
                if isinstance(a, torch.Tensor) and not isinstance(a, DTensor)
                else a
                for a in args
            )

        def outputs(mod: nn.Module, out: Any, mesh: DeviceMesh) -> Any:
            return out.to_local() if isinstance(out, DTensor) else out

        return distribute_module(module, device_mesh, partition, inputs, outputs)  # type: ignore[arg-type]


def _style(name: str) -> ParallelStyle | None:
    """torch's style for a transformers TP style name, or None if we do not translate it."""
    styles: dict[str, Any] = {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
        # per-head norms (Gemma 3's q/k norms) see this rank's heads as [B, S, heads, Dh]
        "replicated_with_grad_allreduce": lambda: SequenceParallel(
            sequence_dim=2, use_local_output=True
        ),
    }
    make = styles.get(name)
    return make() if make is not None else None


def _tp_entries(model: nn.Module, blocks: str) -> tuple[dict[str, str], str | None]:
    """The block-relative ``{module: style name}`` of the model's TP plan, or why not."""
    config = model.config.get_text_config()  # type: ignore[operator,union-attr]
    plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    if not plan:
        return {}, f"{type(model).__name__} has no base_model_tp_plan in transformers"
    prefix = blocks.rsplit(".", 1)[-1] + ".*."
    out: dict[str, str] = {}
    for pattern, style in plan.items():
        if not pattern.startswith(prefix):
            return {}, f"its TP plan shards {pattern!r} outside the decoder layers"
        if _style(style) is None:
            return {}, f"its TP plan uses the style {style!r} ({pattern}), which we do not apply"
        out[pattern.removeprefix(prefix)] = style
    return out, None


def _divisible(args: HFArgs, block: nn.Module, entries: Mapping[str, str]) -> dict[str, int]:
    """Heads, and each sharded projection's split width (outputs of colwise, inputs of rowwise)."""
    sizes = {"n_heads": args.n_heads, "n_kv_heads": args.kv_heads}
    for path, style in entries.items():
        mod = block.get_submodule(path)
        if isinstance(mod, nn.Linear):
            width = mod.out_features if style.startswith("colwise") else mod.in_features
            sizes[path] = width
    return sizes


def _replicated(
    module: nn.Module, skip: set[str], memo: dict[int, tuple[nn.Parameter, nn.Parameter]]
) -> dict[str, ParallelStyle]:
    """A ReplicateParallel for each module (under ``module``) holding parameters of its own
    that no translated style covers."""
    out: dict[str, ParallelStyle] = {}
    for path, mod in module.named_modules():
        if not path or any(path == s or path.startswith(s + ".") for s in skip):
            continue
        if any(True for _ in mod.parameters(recurse=False)):
            out[path] = ReplicateParallel(memo)
    return out


def hf_parallel_plan(args: HFArgs) -> ModelParallelPlan:
    model = meta_model(args)
    blocks = decoder_layers_path(model)
    block0 = model.get_submodule(blocks)[0]  # type: ignore[index]
    entries, refused = _tp_entries(model, blocks)
    block_styles: dict[str, ParallelStyle] = {}
    root_styles: dict[str, ParallelStyle] = {}
    output: str | None = "lm_head"
    if not refused:
        block_styles = {k: s for k, v in entries.items() if (s := _style(v)) is not None}
        block_styles.update(_replicated(block0, set(entries), {}))
        if args.tie_word_embeddings:
            output = None  # the shared matrix stays whole: the head runs replicated too
        root_styles = _replicated(model, {blocks} | ({"lm_head"} if output else set()), {})
    refusals = {"pipeline_parallel": PIPELINE_REFUSAL, "context_parallel": CP_REFUSAL}
    if refused:
        refusals["tensor_parallel"] = refused
    tensor_parallel = TensorParallelPlan(
        root=root_styles,
        block=block_styles,
        output=output,
        divisible=_divisible(args, block0, entries) if not refused else {},
        sequence_parallel=False,
    )
    embedding = "model.embed_tokens" if _has(model, "model.embed_tokens") else None
    return ModelParallelPlan(
        blocks=blocks,
        pipeline_units=_units(blocks, len(model.get_submodule(blocks)), embedding),  # type: ignore[arg-type]
        tensor_parallel=tensor_parallel,
        embedding=embedding,
        context_parallel=None,
        tied_embeddings=args.tie_word_embeddings,
        head="lm_head",
        refusals=refusals,
    )


def _has(model: nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
    except AttributeError:
        return False
    return True


def _units(blocks: str, n: int, embedding: str | None) -> tuple[PipelineUnit, ...]:
    """The model in order (what the memory estimator walks; pipeline parallel is refused)."""
    layers = [PipelineUnit(f"{blocks}.{i}", (f"{blocks}.{i}",)) for i in range(n)]
    first = PipelineUnit("embedding", (embedding,) if embedding else ())
    return (first, *layers, PipelineUnit("head", ("lm_head",)))
