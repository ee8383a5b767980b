"""What the generic parallelism layers need to know about a model, as plain data.

A model family builds one :class:`ModelParallelPlan` from its arguments
(``ModelSpec.parallel_plan``); ``distributed/`` applies it and never names a model attribute
itself (docs/architecture.md, section 5). Paths are module paths relative to the model root
(``"layers"``, ``"attention.core"``), resolved with ``get_submodule``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from torchtitan.distributed.pipeline_stages import PipelineUnit


@dataclass(frozen=True)
class TensorParallelPlan:
    """Tensor-parallel styles (``torch.distributed.tensor.parallel``) by module path.

    ``root`` is applied to the model root, ``block`` to every block. Entries whose module is
    absent (a pipeline stage without the embedding, say) are skipped. ``output`` is the
    vocabulary projection: colwise over the vocabulary, its logits kept sharded under loss
    parallel and gathered otherwise (the generic layer decides, see ``apply_tp``).
    """

    root: Mapping[str, ParallelStyle]
    block: Mapping[str, ParallelStyle]
    output: str | None = None
    divisible: Mapping[str, int] = field(default_factory=dict)
    """Sizes tensor parallel splits (``{"n_heads": 32, ...}``): each must be divisible by the
    TP degree. Config validation and the planner both check them (``tp_problem``)."""
    sequence_parallel: bool = True
    """The residual stream between blocks is sequence-sharded (``Shard(1)``) and enters the
    output projection so; False: it is replicated (plans translated from transformers')."""


@dataclass(frozen=True)
class ContextParallelPlan:
    """Where context parallel plugs in. The model's forward must accept ``positions=`` (global
    token positions; the generic layer passes each rank's share) when ``supported``."""

    attention_core: str
    """Path, inside each block, of the attention core module (``q, k, v -> out`` on
    ``[B, H, S, Dh]``) that the all-gather method replaces."""
    kv_repeat: int
    """Query heads per key/value head (GQA); only the distinct K/V heads are gathered."""
    rope_buffer: str | None = None
    """Root buffer holding the RoPE table that torch's ring attention shards in place."""
    torch_ring: bool = True
    """torch's ring attention (causal, ``context_parallel_method = ring``) can run the model.
    False where a layer outside the attention core reads the whole sequence (linear attention:
    torch's ring patches only SDPA)."""
    whole_inputs: tuple[str, ...] = ()
    """Keyword inputs of the forward that every cp rank receives whole, not split along the
    sequence (per-sample tensors such as a vision-language batch's images); every other
    keyword input is ``[B, S, ...]`` and sharded like the tokens."""


@dataclass(frozen=True)
class ModelParallelPlan:
    blocks: str
    """Path of the ``nn.ModuleDict`` of repeated blocks: each is an FSDP unit, an activation
    checkpointing unit and a compiled region."""
    pipeline_units: tuple[PipelineUnit, ...]
    """The model in order, as the units a pipeline split may cut between."""
    tensor_parallel: TensorParallelPlan
    embedding: str | None = None
    """The token embedding: under TP its (async) output is waited on before compiled blocks."""
    context_parallel: ContextParallelPlan | None = None
    """None: the model cannot run on a sharded sequence."""
    tied_embeddings: bool = False
    """The embedding and output share one weight (pipeline parallel cannot split them)."""
    head: str = "output"
    """Path of the output (vocabulary) projection: float8's ``filter_fqns`` entry ``output``
    names it, so the default keeps it in high precision whatever the family calls it."""
    document_mask: bool = False
    """The forward accepts ``doc_ids=`` (int ``[B, S]``) and then attends only within each
    document (``model.attn_mask_type = "block_causal"``, docs/attention.md); with a CP plan its
    attention core also takes the mask (``q, k, v, mask``)."""

    fsdp_units: tuple[str, ...] = ()
    """Paths of further modules that are each an FSDP unit, sharded in this order before the
    blocks (a vision tower's blocks, then the tower itself: docs/vlm.md)."""

    extra_blocks: tuple[str, ...] = ()
    """Paths of further containers of repeated blocks (``nn.ModuleList`` or ``nn.ModuleDict``: a
    vision tower's blocks): activation checkpointing and torch.compile apply to each of their
    blocks as to those of ``blocks`` (their FSDP units are named in ``fsdp_units``)."""

    refusals: Mapping[str, str] = field(default_factory=dict)
    """Parallelisms this model cannot take, by name (``tensor_parallel``, ``pipeline_parallel``,
    ``context_parallel``) -> why; config validation refuses them with that reason."""

    def blocks_of(self, model: nn.Module) -> nn.ModuleDict:
        blocks = model.get_submodule(self.blocks)
        if not isinstance(blocks, nn.ModuleDict):
            raise TypeError(f"the model's blocks ({self.blocks!r}) must be an nn.ModuleDict")
        return blocks

    @property
    def unit_names(self) -> list[str]:
        return [u.name for u in self.pipeline_units]


def submodule_or_none(model: nn.Module, path: str) -> nn.Module | None:
    """``model.get_submodule(path)``, or None where a pipeline split removed it."""
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None
