"""Pipeline parallelism: split the model into stages and run them with a torch schedule.

Three steps, each usable on its own:

1. :func:`plan_pipeline` (pure arithmetic, no process group; ``validate_config`` calls it) turns
   the config into a :class:`PipelinePlan`: the canonical schedule name, which modules each stage
   owns, and the number of microbatches. Every bad combination is a ``ConfigError``.
2. :func:`split_model` deep-copies the meta model once per local stage and deletes what the
   stage does not own; the per-model plan (TP, FSDP, ...) is then applied to each part.
3. :func:`build_pipeline` wraps the materialized parts in ``torch.distributed.pipelining``
   ``PipelineStage`` objects and builds the schedule; :meth:`Pipeline.step` runs one local batch.

Splitting works on *units*: the token embedding, each transformer block ``layers.<i>`` and the
head (final ``norm`` + ``output``). The embedding and the head count as one unit each, so an
even split of a 6-layer model into 4 stages is ``[emb, 0] [1, 2] [3, 4] [5, head]``, and up to
``n_layers + 2`` stages are possible (the first may hold only the embedding, the last only the
head). Parameter names inside a stage are those of the full model, so initialization and
checkpoints do not depend on the split.

Stage placement follows torch: looped schedules put stage ``s`` on pp rank ``s % pp``; V-shaped
ones (ZBVZeroBubble, DualPipeV) put stages ``r`` and ``2*pp - 1 - r`` on rank ``r``, so the last
stage (the one with the loss) lives on pp rank 0 there, and on pp rank ``pp - 1`` otherwise.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._utils import generate_rank_to_stage_mapping
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    get_schedule_class,
)

from torchtitan.config.errors import ConfigError
from torchtitan.tools.torch_compat import PIPELINE_STAGE_GET_MESH, v_schedule_unsupported_reason

if TYPE_CHECKING:
    from torchtitan.config.job_config import Parallelism

_F = "parallelism.pipeline_parallel_"


@dataclass(frozen=True)
class ScheduleInfo:
    name: str
    """torch's name (``get_schedule_class`` key)."""
    multi_stage: bool
    """Runs several stages per rank (looped/interleaved/V)."""
    v_shaped: bool
    """Exactly two stages per rank, placed in a V (last stage on pp rank 0)."""
    refuses_compile: bool
    """torch refuses compiled stage modules (split input/weight backward)."""
    rounds_rule: bool
    """Microbatches must be a multiple of max(1, microbatches // pp) (torch's flexible rounds)."""


SCHEDULES: dict[str, ScheduleInfo] = {
    s.name: s
    for s in (
        ScheduleInfo("GPipe", False, False, False, False),
        ScheduleInfo("1F1B", False, False, False, False),
        ScheduleInfo("Interleaved1F1B", True, False, False, True),
        ScheduleInfo("LoopedBFS", True, False, False, False),
        ScheduleInfo("InterleavedZeroBubble", True, False, True, True),
        ScheduleInfo("ZBVZeroBubble", True, True, True, False),
        ScheduleInfo("DualPipeV", True, True, True, False),
    )
}
# Spellings people type, after lower-casing and dropping '_', '-', ' ' and '.'.
_ALIASES = {
    **{name.lower(): name for name in SCHEDULES},
    "onefoneb": "1F1B",
    "interleave1f1b": "Interleaved1F1B",
    "interleaved": "Interleaved1F1B",
    "bfs": "LoopedBFS",
    "interleavedzb": "InterleavedZeroBubble",
    "zb1p": "InterleavedZeroBubble",
    "zbv": "ZBVZeroBubble",
    "zbvzb": "ZBVZeroBubble",
}

EMBEDDING = "tok_embeddings"
HEAD = "norm"
"""Unit name of the head: the final norm and the output projection always travel together."""


def normalize_schedule_name(name: str) -> str:
    """Canonical torch schedule name for a case-insensitive common spelling (``interleave_1f1b``)."""
    key = re.sub(r"[\s_\-.]", "", name).lower()
    if key not in _ALIASES:
        raise ConfigError(
            _F + "schedule",
            name,
            "is not a pipeline schedule",
            f"use one of {', '.join(SCHEDULES)}",
        )
    return _ALIASES[key]


def model_units(n_layers: int) -> list[str]:
    """The splittable units in model order: embedding, ``layers.0`` .. ``layers.<n-1>``, head."""
    return [EMBEDDING, *(f"layers.{i}" for i in range(n_layers)), HEAD]


@dataclass(frozen=True)
class PipelinePlan:
    schedule: str
    """Canonical schedule name (a key of ``SCHEDULES``)."""
    pp_degree: int
    stage_units: tuple[tuple[str, ...], ...]
    """Units owned by each stage, indexed by stage id."""
    n_microbatches: int

    @property
    def num_stages(self) -> int:
        return len(self.stage_units)

    @property
    def stages_per_rank(self) -> int:
        return self.num_stages // self.pp_degree

    @property
    def v_shaped(self) -> bool:
        return SCHEDULES[self.schedule].v_shaped

    def stage_ids(self, pp_rank: int) -> list[int]:
        """Stage ids held by ``pp_rank``, in the order the schedule expects them."""
        style = "v" if self.v_shaped else "loop"
        return generate_rank_to_stage_mapping(self.pp_degree, self.num_stages, style=style)[pp_rank]

    @property
    def last_stage_pp_rank(self) -> int:
        """The pp rank holding the last stage, i.e. the loss (0 for V-shaped schedules)."""
        return 0 if self.v_shaped else self.pp_degree - 1

    def last_stage_global_ranks(self, world_size: int) -> list[int]:
        """Global ranks holding the last stage (pp is the outermost mesh axis)."""
        per_pp = world_size // self.pp_degree
        start = self.last_stage_pp_rank * per_pp
        return list(range(start, start + per_pp))

    def describe(self) -> str:
        """e.g. ``stage 0: tok_embeddings, layers.0-2 | stage 1: layers.3-5, norm``."""
        parts = []
        for sid, units in enumerate(self.stage_units):
            layers = [int(u.split(".")[1]) for u in units if u.startswith("layers.")]
            names = [EMBEDDING] if EMBEDDING in units else []
            if layers:
                names.append(
                    f"layers.{layers[0]}-{layers[-1]}" if len(layers) > 1 else f"layers.{layers[0]}"
                )
            names += [HEAD] if HEAD in units else []
            parts.append(f"stage {sid}: {', '.join(names)}")
        return " | ".join(parts)


def _units_from_split_points(split_points: Sequence[str], n_layers: int) -> list[int]:
    """Start index (in ``model_units``) of every stage after the first."""
    units = model_units(n_layers)
    index = {u: i for i, u in enumerate(units)}
    starts = []
    for point in split_points:
        if point not in index:
            raise ConfigError(
                _F + "split_points",
                list(split_points),
                f"{point!r} is not a split point of this {n_layers}-layer model",
                f"use layer names layers.0 .. layers.{n_layers - 1}, or {HEAD!r} to give the head a "
                "stage of its own",
            )
        starts.append(index[point])
    bounds = [0, *starts, len(units)]
    for a, b, point in zip(bounds, bounds[1:], [EMBEDDING, *split_points]):
        if b <= a:
            raise ConfigError(
                _F + "split_points",
                list(split_points),
                f"the stage starting at {point!r} would be empty (split points must be distinct "
                f"and in model order; {EMBEDDING} always starts stage 0)",
                "list each split point once, in increasing layer order",
            )
    return starts


def _even_starts(n_units: int, num_stages: int) -> list[int]:
    """Contiguous, as-even-as-possible split; the first stages take the extra unit (the
    embedding costs almost no compute, the head with the loss costs a lot)."""
    base, extra = divmod(n_units, num_stages)
    sizes = [base + (1 if s < extra else 0) for s in range(num_stages)]
    starts, pos = [], 0
    for size in sizes[:-1]:
        pos += size
        starts.append(pos)
    return starts


def plan_from_config(p: Parallelism, n_layers: int, local_batch_size: int) -> PipelinePlan | None:
    """``plan_pipeline`` for a ``[parallelism]`` section and a model of ``n_layers`` blocks
    (None without pipeline parallel)."""
    if p.pipeline_parallel_degree <= 1:
        return None
    return plan_pipeline(
        n_layers=n_layers,
        pp_degree=p.pipeline_parallel_degree,
        schedule=p.pipeline_parallel_schedule,
        split_points=p.pipeline_parallel_split_points,
        layers_per_stage=p.pipeline_parallel_layers_per_stage,
        microbatches=p.pipeline_parallel_microbatches,
        microbatch_size=p.pipeline_parallel_microbatch_size,
        local_batch_size=local_batch_size,
    )


def plan_pipeline(
    *,
    n_layers: int,
    pp_degree: int,
    schedule: str,
    split_points: Sequence[str],
    layers_per_stage: int,
    microbatches: int,
    microbatch_size: int,
    local_batch_size: int,
) -> PipelinePlan:
    """Check a pipeline configuration and decide the stages and microbatches (no process group)."""
    name = normalize_schedule_name(schedule)
    info = SCHEDULES[name]
    reason = v_schedule_unsupported_reason(name) if info.v_shaped and pp_degree > 1 else None
    if reason:
        raise ConfigError(_F + "schedule", schedule, reason, "use 1F1B or Interleaved1F1B here")
    units = model_units(n_layers)
    n_units = len(units)

    if split_points and layers_per_stage > 0:
        raise ConfigError(
            _F + "layers_per_stage",
            layers_per_stage,
            "cannot be combined with pipeline_parallel_split_points",
            "set one of the two (or neither, for an even split)",
        )
    if layers_per_stage == 0 or layers_per_stage < -1:
        raise ConfigError(
            _F + "layers_per_stage", layers_per_stage, "must be >= 1, or -1", "use -1 (derive it)"
        )
    value: object
    if split_points:
        starts = _units_from_split_points(split_points, n_layers)
        num_stages, field, value = len(starts) + 1, "split_points", list(split_points)
    elif layers_per_stage > 0:
        num_stages = math.ceil(n_units / layers_per_stage)
        field, value, starts = "layers_per_stage", layers_per_stage, []
    else:
        num_stages = pp_degree * (2 if info.multi_stage else 1)
        field, value, starts = "degree", pp_degree, []
    if num_stages > n_units:
        raise ConfigError(
            _F + field,
            value,
            f"asks for {num_stages} stages but the model has only {n_units} layers to place "
            f"({n_layers} transformer blocks plus the embedding and the head)",
            "use fewer pipeline stages (a lower degree, or a single-stage schedule)",
        )
    if not split_points:
        starts = _even_starts(n_units, num_stages)

    stage_text = f"{num_stages} stages on {pp_degree} pipeline ranks"
    if not info.multi_stage and num_stages != pp_degree:
        raise ConfigError(
            _F + field,
            value,
            f"gives {stage_text}, but {name} runs exactly one stage per rank",
            f"use {pp_degree} stages ({pp_degree - 1} split points), or a multi-stage schedule "
            "such as Interleaved1F1B",
        )
    if info.v_shaped and num_stages != 2 * pp_degree:
        raise ConfigError(
            _F + field,
            value,
            f"gives {stage_text}, but {name} needs exactly two stages per rank",
            f"use {2 * pp_degree} stages ({2 * pp_degree - 1} split points), or leave the split "
            "empty",
        )
    if num_stages % pp_degree != 0:
        raise ConfigError(
            _F + field,
            value,
            f"gives {stage_text}: every rank must hold the same number of stages",
            f"make the number of stages a multiple of {pp_degree}",
        )

    # ---- microbatches
    n_mb = microbatches
    if microbatch_size > 0:
        if local_batch_size % microbatch_size != 0:
            raise ConfigError(
                _F + "microbatch_size",
                microbatch_size,
                f"must divide training.local_batch_size = {local_batch_size}",
                "pick a divisor of the local batch size",
            )
        from_size = local_batch_size // microbatch_size
        if microbatches > 0 and microbatches != from_size:
            raise ConfigError(
                _F + "microbatches",
                microbatches,
                f"disagrees with microbatch_size {microbatch_size} "
                f"(local batch {local_batch_size} / {microbatch_size} = {from_size})",
                "set only one of pipeline_parallel_microbatches and _microbatch_size",
            )
        n_mb = from_size
    elif microbatches == 0 or microbatches < -1:
        raise ConfigError(
            _F + "microbatches", microbatches, "must be >= 1, or -1", "use -1 (one per stage)"
        )
    elif microbatches == -1:
        n_mb = num_stages
    if n_mb < num_stages:
        raise ConfigError(
            _F + "microbatches",
            n_mb,
            f"fewer microbatches than pipeline stages ({num_stages}) leaves stages idle and "
            "is refused",
            f"use at least {num_stages} microbatches (and a local batch divisible by that)",
        )
    if local_batch_size % n_mb != 0:
        raise ConfigError(
            _F + "microbatches",
            n_mb,
            f"must divide training.local_batch_size = {local_batch_size}",
            f"set training.local_batch_size to a multiple of {n_mb}",
        )
    rounds = max(1, n_mb // pp_degree)
    if info.rounds_rule and n_mb % rounds != 0:
        raise ConfigError(
            _F + "microbatches",
            n_mb,
            f"{name} needs a multiple of max(1, microbatches // pp degree) = {rounds}",
            f"use a multiple of {pp_degree} microbatches",
        )

    bounds = [0, *starts, n_units]
    stage_units = tuple(tuple(units[a:b]) for a, b in zip(bounds, bounds[1:]))
    return PipelinePlan(name, pp_degree, stage_units, n_mb)


def split_model(model: nn.Module, units: Sequence[str]) -> nn.Module:
    """A deep copy of ``model`` (normally on meta) that keeps only ``units``.

    The model must follow the llama3 layout: ``tok_embeddings``, ``layers`` (a ModuleDict keyed by
    layer id), ``norm`` and ``output``, any of which the forward accepts as ``None``.
    """
    part = copy.deepcopy(model)
    keep = set(units)
    # setattr: a registered submodule may be replaced by None (nn.Module allows it).
    if EMBEDDING not in keep:
        setattr(part, "tok_embeddings", None)  # noqa: B010
    layers = part.get_submodule("layers")
    assert isinstance(layers, nn.ModuleDict)
    for key in list(layers.keys()):
        if f"layers.{key}" not in keep:
            del layers[key]
    if HEAD not in keep:
        setattr(part, "norm", None)  # noqa: B010
        setattr(part, "output", None)  # noqa: B010
    return part


class Pipeline:
    """This rank's stages and the schedule that runs them."""

    def __init__(
        self,
        schedule: PipelineScheduleSingle | PipelineScheduleMulti,
        plan: PipelinePlan,
        stages: list[PipelineStage],
    ) -> None:
        self.schedule = schedule
        self.plan = plan
        self.stages = stages
        self.has_first = any(s.is_first for s in stages)
        self.has_last = any(s.is_last for s in stages)

    def step(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward of one local batch, split into the plan's microbatches.

        Returns the sum of the microbatch losses (each already scaled by the loss function) on
        the rank holding the last stage, ``None`` elsewhere: other stages have no loss.
        """
        return self._run(self.schedule.step, inputs, labels)

    def eval(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        """Forward only (validation), like ``step``: torch runs the schedule with the stages
        in eval mode and switches them back."""
        return self._run(self.schedule.eval, inputs, labels)

    def _run(
        self, run: Callable[..., object], inputs: torch.Tensor, labels: torch.Tensor
    ) -> torch.Tensor | None:
        losses: list[torch.Tensor] | None = [] if self.has_last else None
        run(
            *((inputs,) if self.has_first else ()),
            target=labels if self.has_last else None,
            losses=losses,
            return_outputs=False,
        )
        if losses is None:
            return None
        return torch.stack([loss.detach() for loss in losses]).sum()


def _stage_kwargs(get_mesh: Callable[[tuple[str, ...]], DeviceMesh] | None) -> dict[str, Any]:
    if get_mesh is None or not PIPELINE_STAGE_GET_MESH:
        return {}
    return {"get_mesh": lambda names, _layout: get_mesh(names)}


def build_pipeline(
    parts: Sequence[nn.Module],
    plan: PipelinePlan,
    pp_rank: int,
    pp_group: ProcessGroup,
    device: torch.device,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    get_mesh: Callable[[tuple[str, ...]], DeviceMesh] | None = None,
) -> Pipeline:
    """Wrap this rank's materialized ``parts`` (in ``plan.stage_ids(pp_rank)`` order) in stages.

    ``loss_fn(logits, labels)`` runs on each microbatch of the last stage; it must already divide
    by the number of microbatches (and accumulation steps): the schedule is built with
    ``scale_grads=False``, because torch's own scaling divides *all* of ``.grad``, which would
    also shrink gradients accumulated by earlier steps of gradient accumulation.

    ``get_mesh(dim_names)`` returns the mesh with those axis names; stages need it when the
    activations they exchange are DTensors (tensor parallel keeps the residual stream one), to
    rebuild them from the metadata the neighbouring stage sends.
    """
    stage_ids = plan.stage_ids(pp_rank)
    assert len(parts) == len(stage_ids), f"{len(parts)} parts for stages {stage_ids}"
    stages = [
        PipelineStage(
            part,
            sid,
            plan.num_stages,
            device,
            group=pp_group,
            # (torch 2.11 has no get_mesh: validation refuses PP x TP there, see torch_compat)
            **_stage_kwargs(get_mesh),
        )
        for part, sid in zip(parts, stage_ids)
    ]
    cls = get_schedule_class(plan.schedule)
    schedule: PipelineScheduleSingle | PipelineScheduleMulti
    if SCHEDULES[plan.schedule].multi_stage:
        schedule = cls(
            stages, n_microbatches=plan.n_microbatches, loss_fn=loss_fn, scale_grads=False
        )
    else:
        schedule = cls(
            stages[0], n_microbatches=plan.n_microbatches, loss_fn=loss_fn, scale_grads=False
        )
    return Pipeline(schedule, plan, stages)


def resolve_log_ranks(spec: str, world_size: int, plan: PipelinePlan | None) -> list[int]:
    """``LOG_RANK`` -> sorted global ranks: a comma list of ranks and the words ``last`` (the
    ranks holding the last pipeline stage, where the loss is computed; every rank without PP)
    and ``all``."""
    ranks: set[int] = set()
    for item in (s.strip() for s in spec.split(",")):
        if item == "all":
            ranks.update(range(world_size))
        elif item == "last":
            ranks.update(plan.last_stage_global_ranks(world_size) if plan else range(world_size))
        elif item.isdigit() and int(item) < world_size:
            ranks.add(int(item))
        else:
            raise ValueError(
                f"LOG_RANK item {item!r} is not a rank below {world_size}, 'last' or 'all'"
            )
    return sorted(ranks)


def _main(argv: list[str]) -> int:
    """``python -m torchtitan.distributed.pipeline_parallel LOG_RANK WORLD_SIZE [config args]``:
    print the global ranks ``LOG_RANK`` names, comma-separated (used by run_train.sh)."""
    import sys

    from torchtitan.config.manager import parse_args
    from torchtitan.config.validate import pipeline_plan, validate_config

    spec, world_size = argv[0], int(argv[1])
    plan = None
    try:
        cfg = parse_args(argv[2:], validate=False)
        validate_config(cfg, world_size=world_size)
        plan = pipeline_plan(cfg)
    except ConfigError:
        pass  # the trainer reports the config error itself; 'last' falls back to no-PP
    try:
        print(",".join(map(str, resolve_log_ranks(spec, world_size, plan))))
    except ValueError as e:
        print(f"run_train.sh: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(_main(sys.argv[1:]))
