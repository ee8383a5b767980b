"""Per-step bookkeeping and the log step: loss, grad norm, lr, throughput, MFU, memory, ETA.

Loss bookkeeping between log steps is O(1) in device memory: each step adds its (detached) loss
into one preallocated scalar and overwrites another with the latest value. Nothing is appended
to a list, so memory does not grow with ``log_freq``. At a log step the two scalars are reduced
over the data-parallel (and CP) ranks in one all-reduce and moved to the host.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.components.metrics_writers import MetricWriter
from torchtitan.distributed.utils import all_reduce_
from torchtitan.tools.logging import logger
from torchtitan.tools.memory import DeviceMemoryMonitor


def _fmt_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}"


@dataclass
class LossTracker:
    """Running loss state on the device: the latest step's loss and the sum since the last log."""

    device: torch.device
    last: torch.Tensor = field(init=False)
    total: torch.Tensor = field(init=False)
    count: int = 0

    def __post_init__(self) -> None:
        self.last = torch.zeros((), dtype=torch.float32, device=self.device)
        self.total = torch.zeros((), dtype=torch.float32, device=self.device)

    @torch.no_grad()
    def add(self, loss: torch.Tensor) -> None:
        self.last.copy_(loss.detach())
        self.total.add_(self.last)
        self.count += 1

    def reduce_and_reset(self, loss_mesh: DeviceMesh | None) -> tuple[float, float]:
        """(this step's loss, mean since the last log), averaged over ``loss_mesh``; one all-reduce."""
        packed = torch.stack([self.last, self.total / max(self.count, 1)])
        all_reduce_(packed, loss_mesh, op="avg")
        last, mean = packed.tolist()
        self.total.zero_()
        self.count = 0
        return last, mean


class MetricsProcessor:
    """Collects per-step values and, every ``log_freq`` steps, logs one line and writes scalars."""

    def __init__(
        self,
        *,
        device: torch.device,
        log_freq: int,
        total_steps: int,
        loss_mesh: DeviceMesh | None,
        flops_per_token: int,
        peak_flops: float | None,
        peak_flops_source: str,
        writers: list[MetricWriter],
    ) -> None:
        self.device = device
        self.log_freq = log_freq
        self.total_steps = total_steps
        self.loss_mesh = loss_mesh
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.peak_flops_source = peak_flops_source
        self.writers = writers
        self.memory = DeviceMemoryMonitor(device)
        self.loss = LossTracker(device)
        self.grad_norm = torch.zeros((), dtype=torch.float32, device=device)
        self.tokens_since_log = 0
        self.train_start = time.perf_counter()
        self.last_log_time = self.train_start
        self.last_log_step = 0

    def should_log(self, step: int) -> bool:
        return step == 1 or step % self.log_freq == 0 or step == self.total_steps

    def start_timer(self) -> None:
        """Start the throughput clock (call right before the first step, after set-up)."""
        self.train_start = self.last_log_time = time.perf_counter()

    def end_step(self, loss: torch.Tensor, grad_norm: torch.Tensor, tokens: int) -> None:
        """Record one optimizer step (``tokens`` processed by this rank); no host sync."""
        self.loss.add(loss)
        self.grad_norm.copy_(grad_norm.detach())
        self.tokens_since_log += tokens
        self.memory.sample()

    def log(self, step: int, lr: float) -> dict[str, float | int | None]:
        """Reduce, print one line, write every writer; returns the scalars."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        loss, loss_avg = self.loss.reduce_and_reset(self.loss_mesh)
        grad_norm = float(self.grad_norm.item())
        # Throughput and step time average over the steps since the last log (step 1 includes
        # the first-iteration warm-up, which is why it is slower).
        window = max(now - self.last_log_time, 1e-9)
        step_time = window / max(step - self.last_log_step, 1)
        self.last_log_time, self.last_log_step = now, step
        tps = self.tokens_since_log / window
        mfu = None
        if self.peak_flops:
            mfu = 100.0 * self.flops_per_token * tps / self.peak_flops
        eta = step_time * (self.total_steps - step)
        mem = self.memory.stats()
        metrics: dict[str, float | int | None] = {
            "loss": loss,
            "loss_avg": loss_avg,
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens_per_s": tps,
            "mfu": mfu,
            "step_time_s": step_time,
            "elapsed_s": now - self.train_start,
            "eta_s": eta,
        }
        metrics.update(mem.as_dict(prefix="memory/"))
        mfu_txt = f"  mfu {mfu:5.2f}%" if mfu is not None else ""
        if mem.device_type == "cuda":
            mem_txt = (
                f"mem {mem.peak_gib:.2f}/{mem.peak_reserved_gib:.2f} GiB (alloc/reserved peak)"
            )
        else:
            mem_txt = f"mem rss {mem.rss_gib:.2f} GiB (peak {mem.peak_rss_gib:.2f})"
        logger.info(
            f"step {step:>6}  loss {loss:8.4f} (avg {loss_avg:7.4f})  grad_norm {grad_norm:7.4f}  "
            f"lr {lr:.3e}  tok/s {tps:9,.0f}{mfu_txt}  {mem_txt}  "
            f"elapsed {_fmt_duration(now - self.train_start)}  eta {_fmt_duration(eta)}"
        )
        for w in self.writers:
            w.log(metrics, step)
        self.tokens_since_log = 0
        self.memory.reset_peak()
        return metrics

    def close(self) -> None:
        for w in self.writers:
            w.close()
