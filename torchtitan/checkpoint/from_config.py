"""The checkpoint manager of a run's ``[checkpoint]`` section (docs/checkpoint.md)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchtitan.checkpoint.manager import CheckpointManager
from torchtitan.config.sections import Checkpoint


def build_checkpointer(
    ck: Checkpoint,
    *,
    dump_folder: str,
    total_steps: int,
    model_parts: list[nn.Module],
    optimizer: torch.optim.Optimizer,
    lr_scheduler: Any,
    dataloader: Any,
    hf_adapter: Callable[[], Any],
    resume_settings: dict[str, dict[str, Any]],
) -> CheckpointManager:
    """Saves and loads under ``<dump_folder>/<checkpoint.folder>``; ``hf_adapter()`` (the
    family's Hugging Face converter) is asked for only when ``initial_load_in_hf`` is on."""
    return CheckpointManager(
        root=Path(dump_folder) / ck.folder,
        interval=ck.interval,
        keep_latest_k=ck.keep_latest_k,
        async_mode=ck.async_mode,
        load_step=ck.load_step,
        total_steps=total_steps,
        model_parts=model_parts,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        dataloader=dataloader,
        verify_checksums=ck.verify_checksums,
        exclude_from_loading=tuple(ck.exclude_from_loading),
        initial_load_path=ck.initial_load_path,
        initial_load_model_only=ck.initial_load_model_only,
        initial_load_in_hf=ck.initial_load_in_hf,
        hf_adapter=hf_adapter() if ck.initial_load_in_hf else None,
        last_save_model_only=ck.last_save_model_only,
        export_dtype=getattr(torch, ck.export_dtype),
        resume_settings=resume_settings,
    )
