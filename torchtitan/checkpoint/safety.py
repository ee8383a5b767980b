"""What a resume may not do to the checkpoint folder, and what it tells the user
(docs/checkpoint.md, "Safety").

- A folder whose every resumable checkpoint is invalid is an error, not a fresh start: a fresh
  start would save over them (:func:`refuse_all_invalid`).
- ``checkpoint.load_step`` older than a checkpoint in the folder is refused: the run would save
  its own steps over the newer ones (and ``keep_latest_k`` would purge them), destroying the
  original trajectory. To branch from an older step, load it into a new dump folder with
  ``checkpoint.initial_load_path`` (:func:`refuse_older_load_step`).
- Settings that the loaded state overrides (the optimizer's hyperparameters restored with its
  state, the seed superseded by the restored RNG) are compared with the checkpoint's and every
  one that differs is named in a warning (:func:`report_ignored_settings`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torchtitan.checkpoint import storage as io
from torchtitan.config.job_config import JobConfig
from torchtitan.tools.logging import logger

__all__ = [
    "CheckpointSafetyError",
    "refuse_all_invalid",
    "refuse_older_load_step",
    "report_ignored_settings",
    "resume_settings",
]


class CheckpointSafetyError(RuntimeError):
    """Resuming as configured would lose or overwrite checkpoints."""


def refuse_older_load_step(root: Path, load_step: int) -> None:
    """Raise when ``root`` holds checkpoints newer than ``load_step``."""
    newer = [s for s in io.complete_steps(root) if s > load_step]
    if not newer:
        return
    names = ", ".join(f"step-{s}" for s in newer)
    raise CheckpointSafetyError(
        f"checkpoint.load_step = {load_step}: {root} also holds newer checkpoints ({names}); "
        "resuming here would save over them and lose the original trajectory. To branch from "
        f"step {load_step}, train in a new job.dump_folder with --checkpoint.initial_load_path "
        f"{io.step_dir(root, load_step)} --checkpoint.no-initial_load_model_only (loads "
        "everything, the run continues from that step); or move the newer folders away"
    )


def refuse_all_invalid(root: Path, checksums: bool) -> None:
    """Raise when ``root`` holds resumable checkpoints but none of them verifies."""
    bad = []
    for step in io.complete_steps(root):
        path = io.step_dir(root, step)
        if io.kind(path) == "export":
            continue
        reason = io.verify(path, checksums)
        if reason is None:
            return
        bad.append(f"{path.name}: {reason}")
    if bad:
        raise CheckpointSafetyError(
            f"every checkpoint under {root} is invalid ({'; '.join(bad)}); refusing to start "
            "from step 0, which would save over them. Repair them, move them away, or set "
            "job.dump_folder to a new folder to start afresh"
        )


def report_ignored_settings(
    path: Path,
    saved: dict[str, dict[str, Any]],
    current: dict[str, dict[str, Any]],
    loaded: set[str],
) -> list[str]:
    """Warn about every setting that differs from the checkpoint's and is overridden by a
    loaded component; returns the field names."""
    ignored = []
    for component, fields in current.items():
        if component not in loaded:
            continue
        before = saved.get(component, {})
        for name, value in fields.items():
            if name in before and before[name] != value:
                ignored.append(
                    f"{name} = {value} (the checkpoint's {component} has {before[name]})"
                )
    if ignored:
        logger.warning(
            f"checkpoint: resuming from {path} ignores these settings, which differ from the "
            f"checkpoint's: {'; '.join(ignored)}. The restored state wins; to change them, "
            "exclude that part with checkpoint.exclude_from_loading or start a new run"
        )
    return [s.split(" =")[0] for s in ignored]


def resume_settings(cfg: JobConfig) -> dict[str, dict[str, Any]]:
    """The settings each checkpoint component overrides when it is loaded: the optimizer's
    hyperparameters live in its restored ``param_groups`` (and the LR schedule's base rates),
    the seed's effect in the restored RNG states."""
    o = cfg.optimizer
    opt = {
        "optimizer.lr": o.lr,
        "optimizer.beta1": o.beta1,
        "optimizer.beta2": o.beta2,
        "optimizer.eps": o.eps,
        "optimizer.weight_decay": o.weight_decay,
    }
    out: dict[str, dict[str, Any]] = {"optimizer": opt, "rng": {"debug.seed": cfg.debug.seed}}
    if cfg.lora.enable:  # adapter checkpoints name the base they belong to (docs/lora.md)
        lo = cfg.lora
        out["model"] = {
            "checkpoint.initial_load_path": cfg.checkpoint.initial_load_path,
            "lora.rank": lo.rank,
            "lora.alpha": lo.alpha,
            "lora.use_rslora": lo.use_rslora,
            "lora.quantize_base": lo.quantize_base,
        }
    return out
