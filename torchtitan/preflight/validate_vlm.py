"""Preflight rules of the ``vlm`` dataset (image-text samples, docs/vlm.md): it trains a model
with a vision tower (``qwen3_5_vl``), from an existing parquet file, tar shard or folder of
them, and is not a validation dataset yet."""

from __future__ import annotations

from pathlib import Path

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig
from torchtitan.data.vlm_dataset import source_files

VLM_MODELS = ("qwen3_5_vl",)


def validate_vlm(cfg: JobConfig) -> None:
    """Raise ConfigError on the first broken rule of a ``vlm`` dataset."""
    t, v = cfg.training, cfg.validation
    if v.enable and v.dataset == "vlm":
        raise ConfigError(
            "validation.dataset",
            "vlm",
            "image-text validation is not implemented yet",
            "validate on a text dataset or disable validation (docs/vlm.md)",
        )
    if t.dataset != "vlm":
        return
    if cfg.model.name not in VLM_MODELS:
        raise ConfigError(
            "training.dataset",
            "vlm",
            f"image-text data needs a model with a vision tower (one of {list(VLM_MODELS)}), "
            f"not {cfg.model.name!r}",
            "set --model.name qwen3_5_vl (docs/vlm.md)",
        )
    path = t.dataset_path
    try:
        source_files(Path(path or ""))
    except ValueError as e:
        raise ConfigError(
            "training.dataset_path",
            path,
            str(e),
            "point it at .parquet files or WebDataset .tar shards (scripts/make_vlm_data.py)",
        ) from None
