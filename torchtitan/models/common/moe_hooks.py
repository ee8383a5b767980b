"""The training-loop hooks of every family with MoE layers (``FamilyHooks``, models/spec.py;
docs/moe.md): the auxiliary loss's gradient seed, the expert-load metrics at log steps and the
routing-bias update after each optimizer step. A family sets them with ``hooks=MOE_HOOKS``;
in a model without MoE layers (a dense flavor of the family) each does nothing."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.models.common.moe import set_aux_loss_scale, update_expert_bias
from torchtitan.models.common.moe_metrics import ExpertLoadMetrics
from torchtitan.models.spec import FamilyHooks, MetricsSource, PipelineSource


def seed_aux_loss(parts: list[nn.Module], forwards_per_step: int) -> None:
    """The auxiliary losses are seeded in the backward with the training loss's scale of one
    forward: ``1 / forwards_per_step``."""
    set_aux_loss_scale(parts, 1.0 / forwards_per_step)


def expert_load_metrics(
    parts: list[nn.Module], dp_cp: DeviceMesh | None, pp: PipelineSource | None
) -> list[MetricsSource]:
    """Per-layer expert load and the auxiliary loss (under PP each stage logs its own layers)."""
    load = ExpertLoadMetrics(parts, dp_cp)
    return [load] if load else []


MOE_HOOKS = FamilyHooks(
    after_build=seed_aux_loss,
    metrics_fields=expert_load_metrics,
    after_optimizer_step=update_expert_bias,
)
