"""Pipeline parallelism: split the model into stages and run them with a torch schedule.

Three steps, each usable on its own:

1. :func:`torchtitan.distributed.pipeline_stages.plan_from_config` (pure arithmetic) decides the
   schedule, which units each stage owns and the number of microbatches.
2. :func:`split_model` deep-copies the meta model once per local stage and deletes the modules
   of the units the stage does not own; the parallel plan (TP, FSDP, ...) is then applied to
   each part. Parameter names inside a stage are those of the full model, so initialization and
   checkpoints do not depend on the split.
3. :func:`build_pipeline` wraps the materialized parts in ``torch.distributed.pipelining``
   ``PipelineStage`` objects and builds the schedule; :meth:`Pipeline.step` runs one local batch.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    get_schedule_class,
)

from torchtitan.distributed.pipeline_stages import SCHEDULES, PipelineStages, PipelineUnit
from torchtitan.tools.torch_compat import PIPELINE_STAGE_GET_MESH


def split_model(model: nn.Module, units: Sequence[PipelineUnit], keep: Sequence[str]) -> nn.Module:
    """A deep copy of ``model`` (normally on meta) without the modules of the units not in
    ``keep`` (unit names). A module directly on the root becomes ``None`` (the model's forward
    must accept that, see docs/extending.md); one inside a container (``layers.3``) is deleted."""
    part = copy.deepcopy(model)
    owned = set(keep)
    for unit in units:
        if unit.name in owned:
            continue
        for path in unit.modules:
            parent_path, _, name = path.rpartition(".")
            parent = part.get_submodule(parent_path) if parent_path else part
            if isinstance(parent, nn.ModuleDict):
                del parent[name]
            else:
                setattr(parent, name, None)  # a registered submodule may be replaced by None
    return part


class Pipeline:
    """This rank's stages and the schedule that runs them."""

    def __init__(
        self,
        schedule: PipelineScheduleSingle | PipelineScheduleMulti,
        plan: PipelineStages,
        stages: list[PipelineStage],
    ) -> None:
        self.schedule = schedule
        self.plan = plan
        self.stages = stages
        self.has_first = any(s.is_first for s in stages)
        self.has_last = any(s.is_last for s in stages)

    def step(
        self, inputs: torch.Tensor, labels: torch.Tensor, **kwargs: torch.Tensor
    ) -> torch.Tensor | None:
        """Forward and backward of one local batch, split into the plan's microbatches.
        ``kwargs`` (``[B, ...]`` tensors, e.g. document ids) go to every stage's forward, split
        along the batch like ``inputs`` (torch's schedule does it).

        Returns the sum of the microbatch losses (each already scaled by the loss function) on
        the rank holding the last stage, ``None`` elsewhere: other stages have no loss.
        """
        return self._run(self.schedule.step, inputs, labels, kwargs)

    def eval(
        self, inputs: torch.Tensor, labels: torch.Tensor, **kwargs: torch.Tensor
    ) -> torch.Tensor | None:
        """Forward only (validation), like ``step``: torch runs the schedule with the stages
        in eval mode and switches them back."""
        return self._run(self.schedule.eval, inputs, labels, kwargs)

    def _run(
        self,
        run: Callable[..., object],
        inputs: torch.Tensor,
        labels: torch.Tensor,
        kwargs: dict[str, torch.Tensor],
    ) -> torch.Tensor | None:
        losses: list[torch.Tensor] | None = [] if self.has_last else None
        run(
            *((inputs,) if self.has_first else ()),
            target=labels if self.has_last else None,
            losses=losses,
            return_outputs=False,
            **kwargs,
        )
        if losses is None:
            return None
        return torch.stack([loss.detach() for loss in losses]).sum()


@contextlib.contextmanager
def _eval_mode(module: nn.Module) -> Iterator[None]:
    """``module`` in eval mode for the block, each submodule's own mode restored after."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode


class _Stage(PipelineStage):
    """torch's ``PipelineStage`` whose metadata inference (a forward of its own before the first
    microbatch, on the first microbatch or on placeholder tensors of its shape) runs the module
    in eval mode: statistics a module gathers only in training (the MoE layers' expert load,
    which steps the routing bias; DeepSeek-V3's MTP loss sums) then count the training forwards
    alone, as in one process (docs/pipeline.md). The inference is ``_compute_outputs`` from
    torch 2.13, inside ``_shape_inference`` before."""

    def _compute_outputs(self, *args: Any, module: nn.Module, **kwargs: Any) -> Any:
        with _eval_mode(module):
            return super()._compute_outputs(*args, module=module, **kwargs)

    def _shape_inference(self, *args: Any, **kwargs: Any) -> Any:
        with _eval_mode(self.submod):
            return getattr(super(), "_shape_inference")(*args, **kwargs)  # noqa: B009


def _stage_kwargs(get_mesh: Callable[[tuple[str, ...]], DeviceMesh] | None) -> dict[str, Any]:
    if get_mesh is None or not PIPELINE_STAGE_GET_MESH:
        return {}
    return {"get_mesh": lambda names, _layout: get_mesh(names)}


def build_pipeline(
    parts: Sequence[nn.Module],
    plan: PipelineStages,
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
    stages: list[PipelineStage] = [
        _Stage(
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
