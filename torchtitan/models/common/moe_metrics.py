"""Expert-load metrics of the MoE layers at log steps (docs/moe.md, "Observability").

Between log steps every MoE layer sums its routed-token counts (``load_since_log``) and its
auxiliary loss (``aux_since_log``) on the device: no host synchronisation per step. At a log
step :class:`ExpertLoadMetrics` stacks them, sums the loads over the data-parallel ranks (one
all-reduce, the ranks that saw different tokens), moves one small tensor to the host and resets
the counters. Per layer: the fewest and most tokens an expert received, and the imbalance
``max / mean`` (1.0 = perfectly even; ``E / top_k`` = every token on the same experts); plus the
worst layer's imbalance and the mean auxiliary loss (summed over layers). Under pipeline
parallel each stage reports its own layers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.models.common.moe import MoE

__all__ = ["ExpertLoadMetrics"]

Fields = dict[str, float | int | None]


def _layer_name(name: str) -> str:
    for segment in ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module."):
        name = name.replace(segment, "")
    return name.removesuffix(".feed_forward")


class ExpertLoadMetrics:
    """A metrics source (``MetricsProcessor.extra_fields``): ``() -> (fields, log text)``."""

    def __init__(self, models: list[nn.Module], mesh: DeviceMesh | None) -> None:
        self.layers = [
            (_layer_name(n), m)
            for model in models
            for n, m in model.named_modules()
            if isinstance(m, MoE)
        ]
        self.mesh = mesh if mesh is not None and mesh.size() > 1 else None

    def __bool__(self) -> bool:
        return bool(self.layers)

    @torch.no_grad()
    def __call__(self) -> tuple[Fields, str]:
        if not self.layers:
            return {}, ""
        loads = torch.stack([m.load_since_log for _, m in self.layers])  # [L, E]
        aux = torch.stack([m.aux_since_log for _, m in self.layers])  # [L, 2]
        packed = torch.cat([loads.flatten(), aux.flatten()])
        if self.mesh is not None:
            dist.all_reduce(packed, group=self.mesh.get_group())
        host = packed.cpu()
        for _, m in self.layers:
            m.load_since_log.zero_()
            m.aux_since_log.zero_()
        n_layers = len(self.layers)
        loads_h = host[: loads.numel()].view_as(loads)
        aux_h = host[loads.numel() :].view(n_layers, 2)
        fields: Fields = {}
        worst = 0.0
        for (name, _), load in zip(self.layers, loads_h):
            mean = float(load.mean())
            imbalance = float(load.max()) / mean if mean > 0 else 0.0
            worst = max(worst, imbalance)
            fields[f"moe/{name}/min_tokens"] = float(load.min())
            fields[f"moe/{name}/max_tokens"] = float(load.max())
            fields[f"moe/{name}/imbalance"] = imbalance
        fields["moe/imbalance_max"] = worst
        text = f"  moe imbalance {worst:.2f}"
        calls = aux_h[:, 1]
        if bool((calls > 0).any()):
            aux_mean = float((aux_h[:, 0] / calls.clamp(min=1)).sum())
            fields["moe/aux_loss"] = aux_mean
            text += f" aux {aux_mean:.4f}"
        return fields, text
