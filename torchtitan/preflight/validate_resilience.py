"""Checks of the run's resilience, before any process group exists: the spike policy, the skip
limit, the hang watchdog and the straggler flag (docs/observability.md), and replica fault
tolerance with torchft (docs/fault_tolerance.md): the replica groups' layout, the timeouts, and a
lighthouse that answers."""

from __future__ import annotations

import importlib.util
import math
import os
import time
import urllib.request

from torchtitan.config.errors import ConfigError, require_int
from torchtitan.config.job_config import JobConfig


def _finite_positive(field: str, value: float, fix: str, allow_zero: bool = False) -> None:
    ok = isinstance(value, (int, float)) and math.isfinite(value)
    ok = ok and (value >= 0 if allow_zero else value > 0)
    if not ok:
        rule = "must be a finite number >= 0" if allow_zero else "must be a finite number > 0"
        raise ConfigError(field, value, rule, fix)


def validate_resilience(cfg: JobConfig) -> None:
    t, ft = cfg.training, cfg.fault_tolerance
    require_int(cfg, "training.spike_window", minimum=3)
    require_int(cfg, "training.spike_warmup", minimum=0)
    require_int(cfg, "training.max_consecutive_skips", minimum=0)
    _finite_positive("training.spike_threshold", t.spike_threshold, "use e.g. 6.0")
    if t.spike_policy == "rollback" and not cfg.checkpoint.enable:
        raise ConfigError(
            "training.spike_policy",
            t.spike_policy,
            "rolls back to the last checkpoint, so it needs checkpoint.enable",
            "add --checkpoint.enable (and a checkpoint.interval), or use skip_step",
        )
    _finite_positive(
        "fault_tolerance.watchdog_timeout_seconds",
        ft.watchdog_timeout_seconds,
        "use 0 to turn the watchdog off, or e.g. 60",
        allow_zero=True,
    )
    if 0 < cfg.comm.train_timeout_seconds <= ft.watchdog_timeout_seconds:
        raise ConfigError(
            "fault_tolerance.watchdog_timeout_seconds",
            ft.watchdog_timeout_seconds,
            f"must be shorter than comm.train_timeout_seconds ({cfg.comm.train_timeout_seconds}), "
            "or the collective timeout kills the job before the stacks are written",
            "lower it, e.g. to half of comm.train_timeout_seconds",
        )
    _finite_positive(
        "fault_tolerance.straggler_margin",
        ft.straggler_margin,
        "use 0 (off) or e.g. 0.5 for 50%",
        allow_zero=True,
    )
    require_int(cfg, "fault_tolerance.straggler_log_steps", minimum=1)


START_LIGHTHOUSE = (
    "start one with `torchft_lighthouse --min_replicas 1 --bind [::]:29510` "
    "(or ./run_train.sh with TORCHFT_LIGHTHOUSE=start), then pass its http://host:port"
)


def lighthouse_address(cfg: JobConfig) -> str:
    """fault_tolerance.lighthouse, else the TORCHFT_LIGHTHOUSE environment variable."""
    return cfg.fault_tolerance.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")


def validate_fault_tolerance(cfg: JobConfig) -> None:
    ft = cfg.fault_tolerance
    _validate_semi_sync(cfg)
    if not ft.enable:
        return
    if importlib.util.find_spec("torchft") is None:
        raise ConfigError(
            "fault_tolerance.enable",
            True,
            "replica groups run on torchft, which this environment does not have",
            "pip install 'torchft>=0.2' (the project's ft extra), or turn fault tolerance off",
        )
    if ft.group_size < 2:
        raise ConfigError(
            "fault_tolerance.group_size",
            ft.group_size,
            "fault tolerance needs at least 2 replica groups: each group is one torchrun job, "
            "and the groups together are the data-parallel replicate dimension",
            "set --fault_tolerance.group_size to the number of jobs (>= 2) and give each job "
            "its --fault_tolerance.replica_id 0..group_size-1",
        )
    if not 0 <= ft.replica_id < ft.group_size:
        raise ConfigError(
            "fault_tolerance.replica_id",
            ft.replica_id,
            f"must be in 0..{ft.group_size - 1} (fault_tolerance.group_size {ft.group_size})",
            "give each replica group's job its own id",
        )
    if cfg.parallelism.data_parallel_replicate_degree != 1:
        raise ConfigError(
            "parallelism.data_parallel_replicate_degree",
            cfg.parallelism.data_parallel_replicate_degree,
            "must be 1 with fault_tolerance.enable: the replicas are the separate replica-group "
            "jobs (fault_tolerance.group_size), joined by torchft",
            "set it to 1 and start one job per replica group; inside a job use FSDP/TP/PP",
        )
    if not 1 <= ft.min_replicas <= ft.group_size:
        raise ConfigError(
            "fault_tolerance.min_replicas",
            ft.min_replicas,
            f"must be in 1..fault_tolerance.group_size ({ft.group_size})",
            "use e.g. 1 to go on while any group lives",
        )
    # The timeouts (> 0) and quorum_retries (>= 0): validate_values.RULES, checked before this.
    _validate_with_other_features(cfg)


def _validate_semi_sync(cfg: JobConfig) -> None:
    """semi_sync, sync_every and DiLoCo's outer optimizer: each set only where it is used."""
    ft = cfg.fault_tolerance
    require_int(cfg, "fault_tolerance.sync_every", minimum=1)
    if ft.semi_sync != "none" and not ft.enable:
        raise ConfigError(
            "fault_tolerance.semi_sync",
            ft.semi_sync,
            "semi-synchronous training syncs torchft replica groups, which need "
            "fault_tolerance.enable",
            "add --fault_tolerance.enable with group_size and replica_id, or drop semi_sync",
        )
    if ft.semi_sync == "none" and ft.sync_every != 1:
        raise ConfigError(
            "fault_tolerance.sync_every",
            ft.sync_every,
            "only semi_sync local_sgd or diloco sync every N steps; without it the groups "
            "average gradients every step",
            "set --fault_tolerance.semi_sync diloco (or local_sgd), or drop sync_every",
        )
    for name in ("outer_lr", "outer_momentum"):
        value = getattr(ft, name)
        if value is not None and ft.semi_sync != "diloco":
            raise ConfigError(
                f"fault_tolerance.{name}",
                value,
                f"DiLoCo's outer optimizer is used only with semi_sync diloco (it is "
                f"{ft.semi_sync!r})",
                f"set --fault_tolerance.semi_sync diloco, or drop {name}",
            )
    if ft.outer_lr is not None:
        _finite_positive("fault_tolerance.outer_lr", ft.outer_lr, "use e.g. 0.7 (DiLoCo's)")
    m = ft.outer_momentum
    if m is not None and not (isinstance(m, (int, float)) and 0 <= m < 1):
        raise ConfigError(
            "fault_tolerance.outer_momentum",
            m,
            "must be in [0, 1)",
            "use e.g. 0.9 (DiLoCo's Nesterov momentum), or 0 for plain SGD",
        )


def _validate_with_other_features(cfg: JobConfig) -> None:
    t = cfg.training
    if t.mode != "lm":
        raise ConfigError(
            "training.mode",
            t.mode,
            "fault-tolerant replica groups wrap the language-model step's gradient reduction; "
            "the dpo/grpo steps reduce their own",
            "turn fault_tolerance.enable off for post-training",
        )
    records = t.dataset in ("chat", "vlm")  # their loaders shard by the data-parallel mesh
    if t.data_sharding != "window" or records:
        value = t.dataset if records else t.data_sharding
        raise ConfigError(
            "training.dataset" if records else "training.data_sharding",
            value,
            "fault tolerance hands a recovering group its peer's data position, which is its "
            "own position only under window sharding (every shard at the same window count)",
            "use training.data_sharding = 'window' with a text dataset",
        )
    if t.spike_policy == "rollback":
        raise ConfigError(
            "training.spike_policy",
            t.spike_policy,
            "a rollback reloads a checkpoint in one replica group alone, leaving its peers",
            "use warn or skip_step with fault_tolerance.enable",
        )


def check_lighthouse(cfg: JobConfig) -> None:
    """The lighthouse answers at its address (a network check: last in the preflight)."""
    ft = cfg.fault_tolerance
    if not ft.enable:
        return
    addr = lighthouse_address(cfg)
    if not addr:
        raise ConfigError(
            "fault_tolerance.lighthouse",
            addr,
            "fault tolerance needs the address of torchft's lighthouse (or TORCHFT_LIGHTHOUSE)",
            START_LIGHTHOUSE,
        )
    if not _answers(addr, ft.connect_timeout_seconds):
        raise ConfigError(
            "fault_tolerance.lighthouse",
            addr,
            f"no torchft lighthouse answers there within {ft.connect_timeout_seconds:g} s",
            START_LIGHTHOUSE,
        )


def _answers(addr: str, seconds: float) -> bool:
    """Whether torchft's lighthouse dashboard answers at ``addr`` (HTTP, no proxy) within
    ``seconds``; a refused connection is retried (a lighthouse may be starting)."""
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    end = time.monotonic() + seconds
    while True:
        try:
            with direct.open(addr, timeout=max(end - time.monotonic(), 0.1)) as reply:
                return b"Lighthouse" in reply.read(4096)
        except ValueError:  # not a URL
            return False
        except OSError:
            if time.monotonic() >= end:
                return False
            time.sleep(0.2)
