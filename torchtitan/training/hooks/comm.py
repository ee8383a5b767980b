"""The process groups' training timeout (``comm.train_timeout_seconds``), set after the first
step: that step may take long (compilation, first collectives) under ``comm.init_timeout_seconds``."""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh

from torchtitan.distributed import utils as dist_utils
from torchtitan.training.hooks.base import StepHook


class CommTimeoutHook(StepHook):
    def __init__(self, timeout_seconds: int, mesh: DeviceMesh) -> None:
        self.timeout_seconds = timeout_seconds
        self.mesh = mesh

    def after_step(self, step: int) -> str | None:
        if step == 1:
            dist_utils.set_pg_timeouts(self.timeout_seconds, self.mesh)
        return None
