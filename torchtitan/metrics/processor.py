"""Per-step bookkeeping and the log step: loss, grad norm, lr, throughput, MFU, memory, ETA.

Loss bookkeeping between log steps is O(1) in device memory: each step adds its (detached) loss
into one preallocated scalar and overwrites another with the latest value. Nothing is appended
to a list, so memory does not grow with ``log_freq``. At a log step the two scalars are reduced
over the data-parallel (and CP) ranks in one all-reduce and moved to the host.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.config.sections import FaultTolerance, Metrics
from torchtitan.distributed.utils import all_reduce_
from torchtitan.metrics.writers import MetricWriter
from torchtitan.tools.cross_rank import reduce_extremes
from torchtitan.tools.device_memory import DeviceMemoryMonitor
from torchtitan.tools.logging import logger
from torchtitan.tools.memory_monitor import MemoryMonitor
from torchtitan.tools.stragglers import StragglerFlag


def _fmt_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}"


def _from_pp_rank(values: list[float], pp_mesh: DeviceMesh, src: int) -> list[float]:
    """``values`` as held by pp rank ``src`` (a broadcast over ``pp_mesh``), on every pp rank."""
    packed = torch.tensor(values, dtype=torch.float64, device=pp_mesh.device_type)
    dist.broadcast(packed, group=pp_mesh.get_group(), group_src=src)
    return packed.tolist()


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
        pp_mesh: DeviceMesh | None = None,
        pp_loss_rank: int = 0,
        memory_monitor: MemoryMonitor | None = None,
        cross_rank_view: bool = False,
        stragglers: StragglerFlag | None = None,
    ) -> None:
        self.stragglers = stragglers  # flags slow ranks on the cross-rank view
        self.device = device
        self.log_freq = log_freq
        self.total_steps = total_steps
        self.loss_mesh = loss_mesh
        # Pipeline parallel: only the stage on pp rank ``pp_loss_rank`` of ``pp_mesh`` has a loss.
        self.pp_mesh = pp_mesh if pp_mesh is not None and pp_mesh.size() > 1 else None
        self.pp_loss_rank = pp_loss_rank
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.peak_flops_source = peak_flops_source
        self.writers = writers
        # Per-step memory, warm-up labels and the leak detector (tools/memory_monitor.py).
        self.memory_monitor = memory_monitor or MemoryMonitor(
            DeviceMemoryMonitor(device), leak_window=0
        )
        self.memory = self.memory_monitor.device
        self.cross_rank_view = cross_rank_view
        self.data_time = 0.0  # seconds waiting for batches since the last log (add_data_time)
        self.skipped_steps = 0  # optimizer steps skipped for non-finite values (set by trainer)
        self._steps_since_log = 0
        self.loss = LossTracker(device)
        # More metrics sources, each ``() -> (fields, text)`` called at log steps
        # (a mixture's tokens per source, MoE expert load; set by the trainer).
        self.extra_fields: list[Callable[[], tuple[dict[str, float | int | None], str]]] = []
        self.grad_norm = torch.zeros((), dtype=torch.float32, device=device)
        self.tokens_since_log = 0
        self.train_start = time.perf_counter()
        self.last_log_time = self.train_start
        self.last_log_step = 0

    def should_log(self, step: int) -> bool:
        return step == 1 or step % self.log_freq == 0 or step == self.total_steps

    def start_timer(self, step: int = 0) -> None:
        """Start the throughput clock right before the step after ``step`` (0, or the resumed
        step), after set-up. The next log's window then counts only steps from here: tokens
        and step count of a previous, unlogged stretch (a resume, a second ``train()`` call)
        would otherwise inflate tokens/s and shrink the step time."""
        self.train_start = self.last_log_time = time.perf_counter()
        self.last_log_step = step
        self.tokens_since_log = 0
        self.data_time, self._steps_since_log = 0.0, 0

    def end_step(
        self, loss: torch.Tensor, grad_norm: torch.Tensor, tokens: int, step: int | None = None
    ) -> None:
        """Record one optimizer step (``tokens`` processed by this rank); no host sync."""
        self.loss.add(loss)
        self.grad_norm.copy_(grad_norm.detach())
        self.tokens_since_log += tokens
        self._steps_since_log += 1
        self.memory_monitor.end_step(step if step is not None else self.last_log_step + 1)

    def log(self, step: int, lr: float) -> dict[str, float | int | None]:
        """Reduce, print one line, write every writer; returns the scalars."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        loss, loss_avg = self.loss.reduce_and_reset(self.loss_mesh)
        if self.pp_mesh is not None:
            # Take the last stage's reduced loss and its token count, so every pipeline rank
            # logs and writes the real values (one small tensor, log steps only;
            # docs/architecture.md, section 1, promise 2).
            loss, loss_avg, tokens = _from_pp_rank(
                [loss, loss_avg, self.tokens_since_log], self.pp_mesh, self.pp_loss_rank
            )
            self.tokens_since_log = int(tokens)
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
        mem = self.memory_monitor.log_stats()
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
        obs, obs_txt = self.observability_fields(step_time, mem.peak_gib)
        metrics.update(obs)
        for source in self.extra_fields:
            extra, extra_txt = source()
            metrics.update(extra)
            obs_txt += extra_txt
        mfu_txt = f"  mfu {mfu:5.2f}%" if mfu is not None else ""
        if mem.device_type == "cuda":
            mem_txt = (
                f"mem {mem.peak_gib:.2f}/{mem.peak_reserved_gib:.2f} GiB (alloc/reserved peak)"
            )
        else:
            mem_txt = f"mem rss {mem.rss_gib:.2f} GiB (peak {mem.peak_rss_gib:.2f})"
        logger.info(
            f"step {step:>6}  loss {loss:8.4f} (avg {loss_avg:7.4f})  grad_norm {grad_norm:7.4f}  "
            f"lr {lr:.3e}  tok/s {tps:9,.0f}{mfu_txt}  {mem_txt}{obs_txt}  "
            f"elapsed {_fmt_duration(now - self.train_start)}  eta {_fmt_duration(eta)}"
        )
        for w in self.writers:
            w.log(metrics, step)
        self.tokens_since_log = 0
        self.memory.reset_peak()
        return metrics

    def add_data_time(self, seconds: float) -> None:
        """Time this rank waited for input batches (summed per log window)."""
        self.data_time += seconds

    def exclude_time(self, seconds: float) -> None:
        """Leave ``seconds`` (e.g. a validation run) out of the next throughput and step time."""
        self.last_log_time += seconds

    def observability_fields(
        self, step_time: float, peak_gib: float
    ) -> tuple[dict[str, float | int | None], str]:
        """Memory warm-up/leak state, data time, skipped steps and the cross-rank view: scalars
        for the writers and the text appended to the log line."""
        fields, text = self.memory_monitor.log_fields()
        data_time = self.data_time / max(self._steps_since_log, 1)
        self.data_time, self._steps_since_log = 0.0, 0
        fields["data_time_s"] = data_time
        fields["skipped_steps"] = self.skipped_steps
        if self.skipped_steps:
            text += f"  skipped {self.skipped_steps} step(s) (non-finite)"
        if not self.cross_rank_view:
            return fields, text
        leak = float(fields["memory/leak_mib_per_step"] or 0.0)
        # One int64 MAX all-reduce: min, max and their ranks (tools/cross_rank.py).
        view = reduce_extremes(
            {
                "step_time_s": (step_time, 1e6),
                "data_time_s": (data_time, 1e6),
                "memory_peak_gib": (peak_gib, float(1 << 20)),
                "memory_leak_mib_per_step": (leak, 1024.0),
            },
            rank=dist.get_rank() if dist.is_initialized() else 0,
            device=self.device,
        )
        fields.update({f"ranks/{k}": v for k, v in view.items()})
        if self.stragglers is not None:
            text += self.stragglers.update(self.last_log_step, view)
        if dist.is_initialized() and dist.get_world_size() > 1:
            v = view
            text += (
                f"  ranks: step {v['step_time_s_min']:.2f}-{v['step_time_s_max']:.2f}s "
                f"(max r{v['step_time_s_max_rank']}) data {v['data_time_s_min']:.3f}-"
                f"{v['data_time_s_max']:.3f}s (max r{v['data_time_s_max_rank']}) peak "
                f"{v['memory_peak_gib_min']:.2f}-{v['memory_peak_gib_max']:.2f} GiB "
                f"(max r{v['memory_peak_gib_max_rank']})"
            )
            if v["memory_leak_mib_per_step_max"] > 0:
                text += (
                    f"  LEAK on rank {v['memory_leak_mib_per_step_max_rank']}: "
                    f"+{v['memory_leak_mib_per_step_max']:.2f} MiB/step"
                )
        return fields, text

    def close(self) -> None:
        for w in self.writers:
            w.close()
        self.memory_monitor.close()


def build_metrics(
    m: Metrics,
    ft: FaultTolerance,
    *,
    dump_folder: str,
    total_steps: int,
    writers: list[MetricWriter],
    device: torch.device,
    rank: int,
    loss_mesh: DeviceMesh,
    pp: tuple[DeviceMesh, int] | None,
    flops_per_token: int,
    peak: tuple[float, str],
) -> MetricsProcessor:
    """The processor of ``[metrics]`` (loss, throughput, MFU against ``peak``, memory) feeding
    ``writers``; stragglers flagged when ``fault_tolerance.straggler_margin`` > 0. ``pp``: under
    pipeline parallel the pp mesh and the pp rank of the last stage (whose loss is logged)."""
    memory = MemoryMonitor(
        DeviceMemoryMonitor(device),
        rank=rank,
        warmup_steps=m.memory_warmup_steps,
        leak_window=m.memory_leak_window,
        leak_min_growth_mib=m.memory_leak_min_growth_mib,
        trace_path=f"{dump_folder}/memory/rank_{rank}.jsonl" if m.enable_memory_trace else None,
    )
    return MetricsProcessor(
        device=device,
        log_freq=m.log_freq,
        total_steps=total_steps,
        loss_mesh=loss_mesh,
        flops_per_token=flops_per_token,
        peak_flops=peak[0],
        peak_flops_source=peak[1],
        writers=writers,
        pp_mesh=pp[0] if pp else None,
        pp_loss_rank=pp[1] if pp else 0,
        memory_monitor=memory,
        cross_rank_view=m.enable_cross_rank_view or ft.straggler_margin > 0,
        stragglers=StragglerFlag(ft.straggler_margin, ft.straggler_log_steps)
        if ft.straggler_margin > 0
        else None,
    )
