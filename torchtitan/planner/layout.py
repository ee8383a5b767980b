"""The planner's inputs and outputs: the hardware it plans for, a layout (degrees, AC, batch,
pipeline schedule, memory levers, expert parallel) and a ranked plan (docs/planning.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

from torchtitan.config.job_config import JobConfig
from torchtitan.planner.estimator import MemoryEstimate
from torchtitan.planner.levers import NAMES, apply_levers, lever_overrides

__all__ = ["Hardware", "Layout", "PlanResult"]


@dataclass(frozen=True)
class Hardware:
    """The devices and the network between them."""

    memory_gib: float
    """Usable memory per device."""
    peak_tflops: float = 989.4
    """Dense peak of one device in the compute dtype (default: H100 SXM bf16, datasheet)."""
    gpus_per_node: int = 8
    mfu: float = 0.5
    """Fraction of the peak the model's matmuls reach (model FLOPs utilization ceiling)."""
    intra_node_gbps: float = 450.0
    """Per-device bus bandwidth of collectives inside a node, GB/s (NVLink 4: ~450)."""
    inter_node_gbps: float = 25.0
    """Per-device bus bandwidth that collectives reach across nodes, GB/s. One 400 Gb/s NIC
    per GPU peaks at 50 GB/s; rings over tens of nodes on a shared fabric reach about half."""
    intra_latency_us: float = 10.0
    inter_latency_us: float = 30.0
    fsdp_overlap: float = 0.7
    """Fraction of the compute time FSDP's collectives can hide behind."""
    gemm_half_width: float = 128.0
    """Matmul efficiency is modelled as n / (n + this) in the narrowest dimension n a device
    multiplies; TP divides n, so TP 8 on an 8192-wide model costs about 10% more compute time."""
    prefer_simpler_within: float = 0.05
    """Among layouts predicted within this fraction of the fastest, rank first the one with
    the fewest parallel dimensions (then the smallest TP): the model's error is of that order,
    and every extra dimension is more to tune and debug."""
    headroom: float = 0.1
    """Fraction of the memory kept free: a layout fits when its estimate is at most
    (1 - headroom) x memory_gib (the estimator is calibrated to about 10%)."""
    host_device_gbps: float = 25.0
    """Host-device bandwidth one device sees, GB/s, for CPU offload's copies (planner/levers.py)."""
    host_memory_gbps: float = 10.0
    """Host memory bandwidth one device's CPU optimizer step gets, GB/s (planner/levers.py)."""
    sync_us: float = 0.0
    """What each blocking collective between two computations costs beyond its bytes and latency:
    the ranks' skew (the later rank sets the pace) and the waiting rank's wake-up. Charged to
    tensor and context parallel's activation collectives and FSDP's per-unit ones. 0 on GPUs,
    where NCCL runs on its own streams; on CPU ranks measured by
    benchmarks/planner_vs_measured.py."""
    reduce_scatter_factor: float = 1.0
    """Time of a reduce-scatter relative to an all-gather moving the same bytes (1 for NCCL's
    rings; gloo's CPU reduce-scatter is slower, measured by benchmarks/planner_vs_measured.py)."""
    optimizer_gbps: float = 2000.0
    """Rate at which the optimizer step streams its per-parameter state (parameter, gradient, two
    moments) through memory, GB/s: the device's memory on a GPU (negligible next to a step), the
    host's on CPU ranks, where it is not (measured by benchmarks/planner_vs_measured.py)."""
    document_lengths: tuple[int, ...] = ()
    """The workload's document lengths in tokens (``--document_lengths``): with
    ``model.attn_mask_type = block_causal`` and cp > 1, the attention of the slowest cp rank
    is costed from them (packed into windows as the data loader packs them) under the
    configured load balancer; empty: the ranks are taken as even."""
    device_type: str = "cuda"
    """The devices' kind: it sets the compute dtype's size in the step-time model (``auto``
    mixed precision is bf16 on CUDA, fp32 on CPU). Memory is always estimated for CUDA."""


@dataclass(frozen=True)
class Layout:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    cp: int
    ac_mode: str
    ac_option: str
    local_batch_size: int
    global_batch_size: int
    schedule: str = "1F1B"
    microbatches: int = -1
    levers: tuple[str, ...] = ()
    """Memory levers switched on (``planner/levers.py``)."""
    ep: int = 1
    """Expert parallel degree, borrowed from ``dp_shard`` (MoE models, ``planner/moe_plan.py``)."""

    @property
    def accumulation(self) -> int:
        return self.global_batch_size // (self.local_batch_size * self.dp_replicate * self.dp_shard)

    def describe(self) -> str:
        parts = []
        if self.dp_replicate > 1:
            parts.append(f"dp_replicate {self.dp_replicate}")
        if self.dp_shard > 1:
            parts.append(f"FSDP {self.dp_shard}" + (f" (EP {self.ep})" if self.ep > 1 else ""))
        for name, d in (("TP", self.tp), ("CP", self.cp), ("PP", self.pp)):
            if d > 1:
                parts.append(f"{name} {d}")
        text = " x ".join(parts) or "single device"
        if self.pp > 1:
            text += f" ({self.schedule}, {self.microbatches} microbatches)"
        ac = self.ac_mode if self.ac_mode != "selective" else f"selective {self.ac_option}"
        levers = ", ".join(NAMES[n] for n in self.levers)
        return (
            f"{text}; AC {ac}; local batch {self.local_batch_size}"
            + (f" x {self.accumulation} accumulation steps" if self.accumulation > 1 else "")
            + (f"; {levers}" if levers else "")
        )

    def overrides(self) -> list[str]:
        """Command-line overrides that select this layout."""
        args = [
            f"--parallelism.data_parallel_replicate_degree {self.dp_replicate}",
            f"--parallelism.data_parallel_shard_degree {self.dp_shard}",
            f"--parallelism.tensor_parallel_degree {self.tp}",
            f"--parallelism.context_parallel_degree {self.cp}",
            f"--parallelism.pipeline_parallel_degree {self.pp}",
        ]
        if self.pp > 1:
            args += [
                f"--parallelism.pipeline_parallel_schedule {self.schedule}",
                f"--parallelism.pipeline_parallel_microbatches {self.microbatches}",
            ]
        args += [
            f"--training.local_batch_size {self.local_batch_size}",
            f"--training.global_batch_size {self.global_batch_size}",
            f"--activation_checkpoint.mode {self.ac_mode}",
        ]
        if self.ac_mode == "selective":
            args.append(f"--activation_checkpoint.selective_ac_option {self.ac_option}")
        if self.ep > 1:
            args.append(f"--parallelism.expert_parallel_degree {self.ep}")
        return args + lever_overrides(self.levers)

    def apply(self, cfg: JobConfig) -> JobConfig:
        out = apply_levers(cfg, self.levers)
        p, t, ac = out.parallelism, out.training, out.activation_checkpoint
        p.data_parallel_replicate_degree, p.data_parallel_shard_degree = (
            self.dp_replicate,
            self.dp_shard,
        )
        p.tensor_parallel_degree, p.context_parallel_degree = self.tp, self.cp
        p.pipeline_parallel_degree = self.pp
        p.expert_parallel_degree = self.ep
        p.pipeline_parallel_schedule, p.pipeline_parallel_microbatches = (
            self.schedule,
            self.microbatches,
        )
        p.pipeline_parallel_microbatch_size = -1
        p.pipeline_parallel_split_points, p.pipeline_parallel_layers_per_stage = [], -1
        t.local_batch_size, t.global_batch_size = self.local_batch_size, self.global_batch_size
        ac.mode, ac.selective_ac_option = self.ac_mode, self.ac_option  # type: ignore[assignment]
        return out


@dataclass
class PlanResult:
    layout: Layout
    memory: MemoryEstimate
    step_time_s: float
    tokens_per_s_per_device: float
    terms: dict[str, float]
    """Seconds per step: compute, recompute, bubble, tp, cp, fsdp (exposed), fsdp_total, pp_p2p."""
    reasons: list[str] = field(default_factory=list)
