"""``--parallelism.auto``: the planner's top layout, chosen at launch (docs/planning.md,
"A layout chosen at launch").

Once the world size, the device memory and the model are known, ``plan`` (planner/planner.py)
ranks the layouts that fit and the first one replaces the config's layout fields (degrees,
pipeline schedule and microbatches, local batch, activation checkpointing, memory levers); the
global batch stays the config's. The choice is a pure function of the config, the world size and
the hardware facts of ``hardware_facts`` (the device's name and total memory, the ranks per node:
the same on every rank of a homogeneous job), and ``check_same_layout`` all-gathers it at start
so that a rank that chose differently stops the job before any mesh is built. The entry points
(train.py, config/__main__.py) call ``load_config``; preflight cannot (it sits below planner/).
"""

from __future__ import annotations

import copy
import os
import re
from dataclasses import replace

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig
from torchtitan.config.manager import iter_fields, parse_args_with_sources, to_toml
from torchtitan.distributed.utils import device_type
from torchtitan.planner.estimator import GIB, format_bytes, model_args_for
from torchtitan.planner.layout import Hardware
from torchtitan.planner.planner import plan
from torchtitan.preflight.validate import validate_config, world_size_from_env
from torchtitan.tools.peak_flops import DATASHEET_PEAK_TFLOPS

__all__ = ["CPU_GLOO", "check_same_layout", "choose", "device_peak_tflops", "load_config"]

CPU_GLOO = Hardware(
    memory_gib=1.0,  # replaced by the host's memory / ranks on it (hardware_facts)
    peak_tflops=0.17,
    gpus_per_node=1,
    mfu=0.35,
    intra_node_gbps=0.435,
    inter_node_gbps=0.435,
    intra_latency_us=145.0,
    inter_latency_us=145.0,
    fsdp_overlap=0.0,
    gemm_half_width=32.0,
    reduce_scatter_factor=1.75,
    optimizer_gbps=10.0,
    sync_us=490.0,
    device_type="cpu",
)
"""CPU ranks talking over gloo, as measured on a 2-core machine by
``benchmarks/planner_vs_measured.py`` on a shared 2-core machine (medians: fp32 matmul of one
core, gloo all-gather bandwidth, small all-reduce latency, reduce-scatter/all-gather ratio, fused
AdamW rate; the skew a collective between two computations pays, ``sync_us``; table in
docs/planning.md). gloo runs its collectives on the
same cores as the compute, so nothing hides behind compute (``fsdp_overlap`` 0); the ranks of
one host reach each other alike, so "across nodes" costs what "in a node" does."""

LEVERS = (
    "more ranks, or devices with more memory",
    "a shorter training.seq_len",
    "a smaller training.global_batch_size",
    "a smaller model.flavor",
)


def device_peak_tflops(name: str) -> float:
    """Dense bf16 datasheet peak of a device named like torch.cuda.get_device_name()."""
    for pattern, peaks in DATASHEET_PEAK_TFLOPS:
        if re.search(pattern, name, flags=re.IGNORECASE) and "bf16" in peaks:
            return peaks["bf16"]
    known = ", ".join(p for p, _ in DATASHEET_PEAK_TFLOPS)
    raise ValueError(
        f"--device {name!r} is not in the datasheet table ({known}); give --peak_tflops"
    )


def hardware_facts(world_size: int) -> Hardware:
    """What the planner plans for, from facts every rank of a homogeneous job reads alike: the
    device's name and total memory (CUDA) or the host's memory (CPU), and the ranks per node
    ($LOCAL_WORLD_SIZE under torchrun, else the visible GPUs, else every rank on this host)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    if device_type() == "cuda":
        import torch

        props = torch.cuda.get_device_properties(0)
        try:
            peak = device_peak_tflops(props.name)
        except ValueError:  # unknown device: the default peak (only the ranking matters)
            peak = Hardware(memory_gib=0).peak_tflops
        per_node = local or min(world_size, torch.cuda.device_count())
        return Hardware(
            memory_gib=props.total_memory / GIB, peak_tflops=peak, gpus_per_node=per_node
        )
    per_node = local or world_size
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return replace(CPU_GLOO, memory_gib=host / GIB / per_node, gpus_per_node=per_node)


def choose(cfg: JobConfig, world_size: int, hw: Hardware) -> tuple[JobConfig, str]:
    """The config with the planner's top layout applied, and the log line naming the choice,
    the runner-up and the override line that pins it; ConfigError when nothing fits."""
    results, enumerated, too_big = plan(cfg, model_args_for(cfg), world_size, hw)
    if not results:
        raise ConfigError(
            "parallelism.auto",
            True,
            f"none of the {enumerated} layouts on {world_size} ranks fits in "
            f"{(1 - hw.headroom) * hw.memory_gib:.1f} GiB per device, even with the memory levers",
            "; ".join(LEVERS) + " (or set the layout by hand: python -m torchtitan.planner)",
        )
    best = results[0]
    line = (
        f"parallelism.auto chose {best.layout.describe()}: predicted "
        f"{best.tokens_per_s_per_device:,.0f} tokens/s per device, "
        f"{format_bytes(best.memory.total)} per device"
    )
    if len(results) > 1:
        second = results[1]
        line += (
            f"; runner-up {second.layout.describe()} "
            f"({second.tokens_per_s_per_device:,.0f} tokens/s per device)"
        )
    pin = " ".join(["--no-parallelism.auto", *best.layout.overrides()])
    return best.layout.apply(cfg), f"{line}; pin it with: {pin}"


def _plain(cfg: JobConfig) -> JobConfig:
    """The config with the default layout: validated before planning, so that a bad model,
    path or value is reported as itself and not as a planner failure."""
    out = copy.deepcopy(cfg)
    out.parallelism = replace(JobConfig().parallelism, auto=True)
    out.activation_checkpoint = JobConfig().activation_checkpoint
    return out


def load_config(
    argv: list[str] | None = None, world_size: int | None = None
) -> tuple[JobConfig, dict[str, str], str | None]:
    """Parse and validate like ``preflight.validate.load_config``, applying
    ``--parallelism.auto``: (config, where each value came from, the auto log line or None)."""
    world_size = world_size_from_env() if world_size is None else world_size
    cfg, sources = parse_args_with_sources(argv)
    note = None
    if cfg.parallelism.auto:
        validate_config(_plain(cfg), world_size)
        before = copy.deepcopy(cfg)
        cfg, note = choose(cfg, world_size, hardware_facts(world_size))
        for dotted, *_ in iter_fields():
            if _value(cfg, dotted) != _value(before, dotted):
                sources[dotted] = "parallelism.auto"
    validate_config(cfg, world_size)
    return cfg, sources, note


def _value(cfg: object, dotted: str) -> object:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def check_same_layout(cfg: JobConfig) -> None:
    """All-gather every rank's layout (its default process group must exist); a ConfigError on
    every rank when two differ, before any mesh or model is built."""
    import torch.distributed as dist

    mine = to_toml(cfg)  # the whole config: every rank must run the same one
    every: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    for rank, theirs in enumerate(every):
        if theirs != mine:
            raise ConfigError(
                "parallelism.auto",
                True,
                f"rank {rank} chose another layout than rank {dist.get_rank()} (the hardware "
                "facts differ between ranks)",
                "pin the layout with the override line rank 0 logged, and --no-parallelism.auto",
            )
