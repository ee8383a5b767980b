"""The checkpoint manager of a run's ``[checkpoint]`` section (docs/checkpoint.md)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchtitan.checkpoint.manager import CheckpointManager
from torchtitan.config.sections import Checkpoint

SAME_NAMES = (
    "interval",
    "keep_latest_k",
    "async_mode",
    "load_step",
    "verify_checksums",
    "initial_load_path",
    "initial_load_model_only",
    "initial_load_in_hf",
    "last_save_model_only",
)
"""The fields of ``[checkpoint]`` the manager takes as they are, under the same names."""


def build_checkpointer(
    ck: Checkpoint,
    dump_folder: str,
    total_steps: int,
    state: tuple[list[nn.Module], torch.optim.Optimizer, Any, Any],
    hf_adapter: Callable[[], Any],
    resume_settings: dict[str, dict[str, Any]],
    extra_state: dict[str, Any] | None = None,
) -> CheckpointManager:
    """Saves and loads under ``<dump_folder>/<checkpoint.folder>`` the ``state`` (model parts,
    optimizer, LR schedule, data loader) and ``extra_state`` (a training mode's parts by name);
    ``hf_adapter()`` (the family's Hugging Face converter) is asked for only when
    ``initial_load_in_hf`` is on."""
    model_parts, optimizer, lr_scheduler, dataloader = state
    return CheckpointManager(
        root=Path(dump_folder) / ck.folder,
        total_steps=total_steps,
        model_parts=model_parts,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        dataloader=dataloader,
        exclude_from_loading=tuple(ck.exclude_from_loading),
        hf_adapter=hf_adapter() if ck.initial_load_in_hf else None,
        export_dtype=getattr(torch, ck.export_dtype),
        resume_settings=resume_settings,
        extra_state=extra_state,
        **{name: getattr(ck, name) for name in SAME_NAMES},
    )
