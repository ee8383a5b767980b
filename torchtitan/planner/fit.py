"""Fit before launch: the estimator's peak per rank against the memory of this machine.

At launch only: ``python -m torchtitan.config --launch`` (which ``run_train.sh`` runs before
torchrun) and ``python -m torchtitan.train`` call :func:`check_fit` after ``load_config``
(validating alone, without ``--launch``, does not: a cluster's layout checks on a laptop); it lives here, not in
``preflight/``, because it needs the estimator (docs/architecture.md, section 2: ``planner/`` may
import ``preflight/``, not the reverse). docs/planning.md, "Fit before launch":

- CUDA: the per-rank peak against the free memory of the rank's GPU (``torch.cuda.mem_get_info``).
- CPU: the ranks on this host share its memory, so ``ranks on the host x per-rank peak`` against
  the available host memory (``psutil``).
- FSDP CPU offload keeps parameters, gradients and optimizer state in host memory: that host
  side, times the ranks on the host, against the available host memory too.

Above the memory: a ``ConfigError`` (``job.fit_check = "error"``, the default) or a warning
(``"warn"``); above ``WARN_FRACTION`` of it: a warning; ``"off"`` skips the check. The estimator is arithmetic: this costs
milliseconds.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import psutil
import torch

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.utils import device_type as detect_device_type
from torchtitan.models import MODELS, flavor_of
from torchtitan.planner.estimator import GIB, estimate_memory
from torchtitan.tools.logging import logger

WARN_FRACTION = 0.9
"""Warn when the estimate needs more than this share of the memory it is compared with."""


@dataclass(frozen=True)
class Budget:
    """One comparison: ``needed`` bytes of ``what`` against ``available`` bytes."""

    what: str
    needed: int
    available: int
    detail: str

    @property
    def share(self) -> float:
        return self.needed / max(self.available, 1)


def ranks_on_host(world_size: int) -> int:
    """The ranks sharing this host: torchrun's ``LOCAL_WORLD_SIZE``, else the whole world (the
    pre-launch check of ``run_train.sh`` is given ``--world_size $NGPU``, the ranks of this host)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE") or world_size)


def _cuda_free_bytes() -> int:
    """Free memory of this rank's GPU (``LOCAL_RANK``; before launch, the smallest of all)."""
    if "LOCAL_RANK" in os.environ:
        return int(torch.cuda.mem_get_info(int(os.environ["LOCAL_RANK"]))[0])
    return min(int(torch.cuda.mem_get_info(i)[0]) for i in range(torch.cuda.device_count()))


def budgets(
    cfg: JobConfig,
    world_size: int,
    dev_type: str,
    device_free: int | None = None,
    host_available: int | None = None,
) -> list[Budget]:
    """What the config needs of each memory of this machine, per the estimator."""
    est = estimate_memory(cfg, world_size, device_type=dev_type)
    host = psutil.virtual_memory().available if host_available is None else host_available
    ranks = ranks_on_host(world_size)
    out: list[Budget] = []
    if dev_type == "cuda":
        free = _cuda_free_bytes() if device_free is None else device_free
        out.append(Budget("GPU memory", est.total, free, f"estimated peak per rank ({est.phase})"))
    else:
        out.append(
            Budget(
                "host memory",
                ranks * est.total,
                host,
                f"{ranks} rank(s) on this host x {est.total / GIB:.2f} GiB estimated peak "
                f"per rank ({est.phase})",
            )
        )
    if est.host:
        out.append(
            Budget(
                "host memory (FSDP CPU offload)",
                ranks * est.host,
                host,
                f"{ranks} rank(s) x {est.host / GIB:.2f} GiB offloaded per rank",
            )
        )
    return out


# What the estimator reads of a flavor (models/spec.py, DecoderShape).
_SHAPE = ("dim", "n_heads", "head_dim", "kv_heads", "hidden_dim", "tie_word_embeddings")


def _estimable(cfg: JobConfig) -> bool:
    """Whether the estimator models this family's shape; a family that declares another shape
    (a test's toy model) is not checked, and the log says so."""
    spec = MODELS.get(cfg.model.name)
    args = spec.flavors.get(flavor_of(cfg)) if spec is not None else None
    missing = [n for n in _SHAPE if args is not None and not hasattr(args, n)]
    if missing:
        logger.info(
            f"job.fit_check: skipped, the memory estimator does not model {cfg.model.name}'s "
            f"shape (its args have no {missing[0]})"
        )
    return not missing


def check_fit(
    cfg: JobConfig,
    world_size: int,
    dev_type: str | None = None,
    device_free: int | None = None,
    host_available: int | None = None,
) -> list[str]:
    """Raise ConfigError when the job cannot fit (``job.fit_check = "error"``); return (and log)
    the warnings: close to the memory, or above it under ``"warn"``."""
    mode = cfg.job.fit_check
    if mode == "off" or not _estimable(cfg):
        return []
    dev_type = detect_device_type() if dev_type is None else dev_type
    warnings: list[str] = []
    for b in budgets(cfg, world_size, dev_type, device_free, host_available):
        text = (
            f"{b.detail} = {b.needed / GIB:.2f} GiB, {b.share:.0%} of the "
            f"{b.available / GIB:.2f} GiB of {b.what} available"
        )
        if b.share > 1.0 and mode == "error":
            raise ConfigError(
                "job.fit_check",
                mode,
                f"the job does not fit: {text}",
                "shorten training.seq_len or training.local_batch_size, use more ranks or the "
                "memory levers (python -m torchtitan.planner proposes a layout), or set "
                "--job.fit_check warn (or off) to launch anyway",
            )
        if b.share > WARN_FRACTION:
            warnings.append(f"memory fit: {text}; expect out-of-memory near the peak")
    for w in warnings:
        logger.warning(w)
    return warnings
