"""Pipeline stages: pure arithmetic from the config to a :class:`PipelineStages` (no process
group, no model). Config validation, the trainer, ``--job.explain``, the estimator and the
planner all call :func:`plan_from_config`, so they agree on the stages by construction
(docs/architecture.md, section 4).

Splitting works on *units*, which the model's parallel plan names in model order
(``ModelParallelPlan.pipeline_units``): for a decoder, the token embedding, each block and the
head (final norm + output projection travel together). The first and last units count as one
unit each, so an even split of a 6-block model into 4 stages is ``[emb, 0] [1, 2] [3, 4]
[5, head]``, and up to ``n_blocks + 2`` stages are possible.

Stage placement follows torch: looped schedules put stage ``s`` on pp rank ``s % pp``; V-shaped
ones (ZBVZeroBubble, DualPipeV) put stages ``r`` and ``2*pp - 1 - r`` on rank ``r``, so the last
stage (the one with the loss) lives on pp rank 0 there, and on pp rank ``pp - 1`` otherwise.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from torch.distributed.pipelining._utils import generate_rank_to_stage_mapping

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import Parallelism
from torchtitan.tools.torch_compat import v_schedule_unsupported_reason

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


@dataclass(frozen=True)
class PipelineUnit:
    """One indivisible piece of a pipeline split: a name users write in ``split_points`` and the
    module paths (relative to the model root) that belong to it."""

    name: str
    modules: tuple[str, ...]


@dataclass(frozen=True)
class PipelineStages:
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
        return " | ".join(
            f"stage {sid}: {', '.join(_compress(units))}"
            for sid, units in enumerate(self.stage_units)
        )


def _compress(units: Sequence[str]) -> list[str]:
    """``layers.0, layers.1, layers.2`` -> ``layers.0-2``: runs of numbered units in one item."""
    out: list[tuple[str, int, int] | str] = []
    for u in units:
        prefix, _, idx = u.rpartition(".")
        last = out[-1] if out else None
        if (
            idx.isdigit()
            and isinstance(last, tuple)
            and last[0] == prefix
            and last[2] + 1 == int(idx)
        ):
            out[-1] = (prefix, last[1], int(idx))
        elif idx.isdigit():
            out.append((prefix, int(idx), int(idx)))
        else:
            out.append(u)
    return [
        item
        if isinstance(item, str)
        else f"{item[0]}.{item[1]}" + (f"-{item[2]}" if item[2] > item[1] else "")
        for item in out
    ]


def _units_from_split_points(split_points: Sequence[str], units: Sequence[str]) -> list[int]:
    """Start index (in ``units``) of every stage after the first."""
    index = {u: i for i, u in enumerate(units)}
    starts = []
    for point in split_points:
        if point not in index:
            raise ConfigError(
                _F + "split_points",
                list(split_points),
                f"{point!r} is not a split point of this model",
                f"use unit names {units[1]} .. {units[-2]}, or {units[-1]!r} to give the last "
                "unit a stage of its own",
            )
        starts.append(index[point])
    bounds = [0, *starts, len(units)]
    for a, b, point in zip(bounds, bounds[1:], [units[0], *split_points]):
        if b <= a:
            raise ConfigError(
                _F + "split_points",
                list(split_points),
                f"the stage starting at {point!r} would be empty (split points must be distinct "
                f"and in model order; {units[0]} always starts stage 0)",
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


def plan_from_config(
    p: Parallelism, units: Sequence[str], local_batch_size: int
) -> PipelineStages | None:
    """``plan_pipeline`` for a ``[parallelism]`` section and the model's pipeline unit names
    (None without pipeline parallel)."""
    if p.pipeline_parallel_degree <= 1:
        return None
    return plan_pipeline(
        units=units,
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
    units: Sequence[str],
    pp_degree: int,
    schedule: str,
    split_points: Sequence[str],
    layers_per_stage: int,
    microbatches: int,
    microbatch_size: int,
    local_batch_size: int,
) -> PipelineStages:
    """Check a pipeline configuration and decide the stages and microbatches (no process group)."""
    name = normalize_schedule_name(schedule)
    reason = (
        v_schedule_unsupported_reason(name) if SCHEDULES[name].v_shaped and pp_degree > 1 else None
    )
    if reason:
        raise ConfigError(_F + "schedule", schedule, reason, "use 1F1B or Interleaved1F1B here")
    units = list(units)
    starts = _stage_starts(units, pp_degree, name, split_points, layers_per_stage)
    n_mb = _microbatches(
        len(starts) + 1, pp_degree, name, microbatches, microbatch_size, local_batch_size
    )
    bounds = [0, *starts, len(units)]
    stage_units = tuple(tuple(units[a:b]) for a, b in zip(bounds, bounds[1:]))
    return PipelineStages(name, pp_degree, stage_units, n_mb)


def _stage_starts(
    units: list[str],
    pp_degree: int,
    name: str,
    split_points: Sequence[str],
    layers_per_stage: int,
) -> list[int]:
    """Index in ``units`` where each stage after the first starts; ConfigError if the split
    does not fit the schedule."""
    info = SCHEDULES[name]
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
        starts = _units_from_split_points(split_points, units)
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
            f"({units[0]} .. {units[-1]})",
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
    return starts


def _microbatches(
    num_stages: int,
    pp_degree: int,
    name: str,
    microbatches: int,
    microbatch_size: int,
    local_batch_size: int,
) -> int:
    """The number of microbatches per local batch; ConfigError if it cannot work."""
    info = SCHEDULES[name]
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
    return n_mb
