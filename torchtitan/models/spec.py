"""The contract between a model family and the rest of the library (docs/extending.md).

The trainer, config validation, ``--job.explain``, the estimator and the planner reach a model
only through ``MODELS[name]``, an object satisfying :class:`ModelSpec`. Everything
model-specific (architecture, parallel plans, FLOPs, Hugging Face names) lives in the family's
folder ``models/<name>/``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.distributed.model_plan import ModelParallelPlan
from torchtitan.models.common.hf import HFMapping
from torchtitan.models.common.hf import StateDictAdapter as HFStateDictAdapter


class ModelArgs(Protocol):
    """What the generic layers read from a flavor's arguments (a dataclass: the trainer sets
    ``vocab_size`` from the tokenizer and ``max_seq_len`` from ``training.seq_len``)."""

    n_layers: int
    vocab_size: int
    max_seq_len: int


class DecoderShape(ModelArgs, Protocol):
    """The shape of a dense decoder-only transformer, as the memory estimator and the planner
    model it (``planner/``)."""

    dim: int
    n_heads: int
    tie_word_embeddings: bool

    @property
    def head_dim(self) -> int: ...

    @property
    def kv_heads(self) -> int: ...

    @property
    def hidden_dim(self) -> int: ...


class StateDictAdapter(Protocol):
    """Converts full (unsharded) state dicts between our parameter names and Hugging Face's."""

    def to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...

    def from_hf(self, hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...


class TrainableModel(Protocol):
    """What the trainer calls on a built model beyond ``nn.Module``: ``init_weights`` after
    ``to_empty`` (the same seed gives the same weights whatever the parallelism or split).

    Three members are optional (read through :func:`batch_inputs`, :func:`image_inputs` and
    :func:`buffer_init`, which give their defaults): ``batch_inputs(tokens) -> dict`` adds
    keyword inputs to every batch, made from whole sequences before context parallel shards them
    and given to every pipeline stage (default: none; DeepSeek-V3's multi-token prediction
    tokens); ``image_inputs(tokens, pixel_values, grid_thw, microbatched) -> dict`` gives an
    image batch's keyword inputs, likewise from whole sequences, each splittable along the
    batch when ``microbatched`` (a pipeline schedule) (default: the collated two as they are;
    qwen3_5_vl's per-sample form, docs/vlm.md); ``init_buffers(device)`` fills the buffers
    alone, so that the weights' init can wait for a checkpoint load that would overwrite them
    (default: no such split, the weights are initialised at build)."""

    def init_weights(self, seed: int = 0, buffer_device: torch.device | None = None) -> None: ...


def batch_inputs(part: nn.Module, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """The optional ``TrainableModel.batch_inputs`` of a model (part): its extra keyword inputs
    for a batch of ``tokens``, ``{}`` when it declares none."""
    method = getattr(part, "batch_inputs", None)
    return method(tokens) if callable(method) else {}


def image_inputs(
    part: nn.Module,
    tokens: torch.Tensor,
    pixel_values: torch.Tensor,
    grid_thw: torch.Tensor,
    microbatched: bool,
) -> dict[str, torch.Tensor]:
    """The optional ``TrainableModel.image_inputs`` of a model (part): the keyword inputs of an
    image batch, by default its ``pixel_values`` and ``grid_thw`` as collated."""
    method = getattr(part, "image_inputs", None)
    if callable(method):
        return method(tokens, pixel_values, grid_thw, microbatched)
    return {"pixel_values": pixel_values, "grid_thw": grid_thw}


def buffer_init(part: nn.Module) -> Callable[[torch.device], None] | None:
    """The optional ``TrainableModel.init_buffers`` of a model (part), or None."""
    return getattr(part, "init_buffers", None)


MetricsSource = Callable[[], tuple[dict[str, float | int | None], str]]
"""A source of extra metrics at log steps (``MetricsProcessor.extra_fields``): ``() -> (fields,
log text)``."""

PipelineSource = tuple[DeviceMesh, int]
"""Under pipeline parallel: the pp mesh and the pp rank of the last stage, whose values a
metrics source gives to every pp rank."""


def _after_build(parts: list[nn.Module], forwards_per_step: int) -> None:
    pass


def _metrics_fields(
    parts: list[nn.Module], dp_cp: DeviceMesh | None, pp: PipelineSource | None
) -> list[MetricsSource]:
    return []


def _after_optimizer_step(parts: list[nn.Module], dp_cp: DeviceMesh | None) -> None:
    pass


@dataclasses.dataclass(frozen=True)
class FamilyHooks:
    """What a family adds to the training loop, called by the trainer on this rank's model
    ``parts`` (docs/architecture.md, "Adding a family hook"). Each defaults to nothing; MoE
    families share ``models/common/moe_hooks.py: MOE_HOOKS``."""

    after_build: Callable[[list[nn.Module], int], None] = _after_build
    """``(parts, forwards_per_step)``: once, after the parts are built and parallelized;
    ``forwards_per_step`` is gradient accumulation x pipeline microbatches."""
    metrics_fields: Callable[
        [list[nn.Module], DeviceMesh | None, PipelineSource | None], list[MetricsSource]
    ] = _metrics_fields
    """``(parts, dp_cp mesh, pipeline source)``: the family's metrics sources, logged at log
    steps after the loss (values averaged or summed over ``dp_cp`` by the source)."""
    after_optimizer_step: Callable[[list[nn.Module], DeviceMesh | None], None] = (
        _after_optimizer_step
    )
    """``(parts, dp_cp mesh)``: after every optimizer step that was taken."""


NO_HOOKS = FamilyHooks()


class ModelSpec(Protocol):
    """One model family: its flavors, how to build it and what its parallelisms need."""

    @property
    def name(self) -> str: ...

    @property
    def flavors(self) -> Mapping[str, Any]:
        """Flavor name -> the family's args dataclass (satisfying :class:`ModelArgs`)."""
        ...

    def build(self, args: Any) -> nn.Module:
        """The model, called under ``torch.device("meta")``; the module satisfies
        :class:`TrainableModel` and its forward takes token ids (or, on a pipeline stage
        without the embedding, hidden states) and returns logits."""
        ...

    def parallel_plan(self, args: Any) -> ModelParallelPlan:
        """TP styles, pipeline units, blocks, CP attention core: applied by ``distributed/``."""
        ...

    def num_params(self, args: Any) -> int: ...

    def flops_per_token(self, args: Any, seq_len: int) -> int:
        """Training FLOPs (forward + backward) per token at ``seq_len``, for MFU."""
        ...

    def state_dict_adapter(self, args: Any) -> StateDictAdapter | None:
        """The Hugging Face converter, or None when the family has no Hugging Face format."""
        ...

    @property
    def hooks(self) -> FamilyHooks:
        """What the family adds to the training loop (``NO_HOOKS``: nothing)."""
        ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class FamilySpec:
    """The one :class:`ModelSpec` implementation a family instantiates with its pieces, by
    keyword (docs/extending.md, section 4): its args carry the closed-form counts
    (``num_params``, ``flops_per_token``; ``models/common/args.py``), its ``hf`` mapping and
    ``adapter`` class give the Hugging Face converter."""

    name: str
    flavors: Mapping[str, Any]
    """Flavor name -> args (the family's table itself, so flavors registered later are seen)."""
    model: Callable[[Any], nn.Module]
    plan: Callable[[Any], ModelParallelPlan]
    hf: HFMapping | None = None
    hf_model_types: tuple[str, ...] = ()
    """The ``model_type`` values of the transformers ``config.json`` files this family reads."""
    lora_targets: tuple[str, ...] = ("attention.wq", "attention.wk", "attention.wv", "attention.wo")
    """What ``lora.target_modules = []`` (the default) adapts: the family's attention
    projections (docs/lora.md)."""
    adapter: Callable[[HFMapping, Any], HFStateDictAdapter] = HFStateDictAdapter
    """The converter class applying ``hf`` (a family whose checkpoints hold more than the
    mapping says subclasses the shared one: DeepSeek-V3's MTP layers, Qwen3.5's multimodal
    wrapper)."""
    hooks: FamilyHooks = NO_HOOKS
    """What the family adds to the training loop (MoE families: ``MOE_HOOKS``)."""

    def build(self, args: Any) -> nn.Module:
        return self.model(args)

    def parallel_plan(self, args: Any) -> ModelParallelPlan:
        return self.plan(args)

    def num_params(self, args: Any) -> int:
        return int(args.num_params())

    def flops_per_token(self, args: Any, seq_len: int) -> int:
        return int(args.flops_per_token(seq_len))

    def state_dict_adapter(self, args: Any) -> HFStateDictAdapter | None:
        return None if self.hf is None else self.adapter(self.hf, args)


def runtime_args(
    spec: ModelSpec, flavor: str, vocab_size: int, seq_len: int, attn_backend: str | None = None
) -> Any:
    """The flavor's args with the tokenizer's vocabulary and the training sequence length:
    what the trainer builds and what the estimator and planner model. ``attn_backend`` (resolved,
    ``sdpa``/``flex``) is set where the family's args have that field (docs/attention.md)."""
    args = spec.flavors[flavor]
    extra: dict[str, Any] = {}
    names = {f.name for f in dataclasses.fields(args)}
    if attn_backend is not None and "attn_backend" in names:
        extra["attn_backend"] = attn_backend
    return dataclasses.replace(args, vocab_size=vocab_size, max_seq_len=seq_len, **extra)
