"""The memory levers as the planner proposes them (docs/memory.md, docs/planning.md).

When no layout fits, the planner tries again with the levers switched on cumulatively, cheapest
first: chunked linear + cross-entropy (costs one more forward matmul of the output projection),
then bf16 Adam moments (costs nothing in time; stochastic rounding keeps the loss within 1% in
our 200-step check), then FSDP CPU offload (costs the host-device copies and a CPU optimizer
step). When full fine-tuning fits under none of them: LoRA (adapters on a frozen base), then
QLoRA (its base in NF4; no TP, CP or replication). The first set under which a layout fits is the one
shown.

Offload's predicted slow-down, per step and device, with ``P`` this device's parameter shard
elements::

    copies    = (gathers x P x 4 bytes host-to-device + P x 4 bytes of gradients back)
                / host_device_gbps            (not overlapped: an upper bound)
    optimizer = P x 32 bytes / host_memory_gbps   (read and write of fp32 weights, gradients
                and two moments on the CPU; 24 with bf16 moments)

``host_device_gbps`` defaults to 25 GB/s (PCIe 5.0 x16 peaks at ~64 GB/s per direction; with
eight GPUs sharing host links and memory, ~25 is what one device sees) and
``host_memory_gbps`` to 10 GB/s per device (a two-socket host's ~400 GB/s shared by eight GPUs'
optimizer threads, at the ~20% a PyTorch CPU AdamW reaches): both are options of
``python -m torchtitan.planner``.
"""

from __future__ import annotations

import copy

from torchtitan.config.job_config import JobConfig

CHUNK = 4096
"""Tokens per chunk the planner proposes for the chunked loss."""

LEVER_SETS: tuple[tuple[str, ...], ...] = (
    (),
    ("chunked_loss",),
    ("chunked_loss", "bf16_moments"),
    ("chunked_loss", "bf16_moments", "cpu_offload"),
    # Not full fine-tuning any more: adapters on a frozen base, then an NF4 base (docs/lora.md).
    ("chunked_loss", "lora"),
    ("chunked_loss", "lora", "qlora"),
)

NAMES = {
    "chunked_loss": "chunked cross-entropy",
    "bf16_moments": "bf16 Adam moments",
    "cpu_offload": "FSDP CPU offload",
    "lora": "LoRA (frozen base, adapters on every projection)",
    "qlora": "QLoRA (NF4 base; FSDP and PP only)",
}

LORA_TARGETS = ["attention.w*", "feed_forward.w*"]
"""What the planner adapts: every attention and dense SwiGLU projection."""


def apply_levers(cfg: JobConfig, levers: tuple[str, ...]) -> JobConfig:
    out = copy.deepcopy(cfg)
    if "chunked_loss" in levers:
        out.training.loss_chunk_size = CHUNK
        # The chunked loss is not compiled (preflight refuses compile.components loss with it).
        out.compile.components = [c for c in out.compile.components if c != "loss"] or ["model"]
    if "bf16_moments" in levers:
        out.optimizer.moments_dtype = "bfloat16"
    if "cpu_offload" in levers:
        out.parallelism.fsdp_cpu_offload = True
    if "lora" in levers:
        out.lora.enable, out.lora.target_modules = True, list(LORA_TARGETS)
    if "qlora" in levers:
        out.lora.quantize_base = "nf4"
    return out


def lever_overrides(levers: tuple[str, ...]) -> list[str]:
    flags = {
        "chunked_loss": f"--training.loss_chunk_size {CHUNK} --compile.components model",
        "bf16_moments": "--optimizer.moments_dtype bfloat16",
        "cpu_offload": "--parallelism.fsdp_cpu_offload",
        "lora": f"--lora.enable --lora.target_modules {','.join(LORA_TARGETS)}",
        "qlora": "--lora.quantize_base nf4",
    }
    return [flags[name] for name in levers]


def chunked_loss_seconds(tokens_device: float, dim: int, vocab: float, peak_flops: float) -> float:
    """The recomputed forward matmul of the output projection (2 x tokens x dim x vocab)."""
    return 2 * tokens_device * dim * vocab / peak_flops


def offload_seconds(
    shard_params: float,
    gathers: int,
    moments_bytes: int,
    host_device_gbps: float,
    host_memory_gbps: float,
) -> tuple[float, float]:
    """(host-device copies, CPU optimizer step) in seconds per step, see the module doc."""
    copies = (gathers * shard_params * 4 + shard_params * 4) / (host_device_gbps * 1e9)
    optimizer = shard_params * (4 + 4 + moments_bytes) * 2 / (host_memory_gbps * 1e9)
    return copies, optimizer
