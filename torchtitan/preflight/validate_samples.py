"""Preflight rules of the record datasets (before any process group):

- ``chat`` and the ``[sft]`` section (docs/sft.md): the file exists, every record is a
  well-formed conversation (the error names the file and line), and the file tokenized as the
  dataset will tokenize it leaves a conversation to train on (with ``sft.overlong = "error"``:
  none is longer than the sequence);
- ``vlm`` (image-text samples, docs/vlm.md), alone or as ``[[training.mixture]]`` sources with
  ``dataset = "vlm"``: it trains a model with a vision tower (``qwen3_5_vl``, ``kimi_k25``),
  from an existing parquet file, tar shard or folder of them, and is not a validation dataset
  yet; ``training.image_tokens_per_sample`` is within the row and only set for such a model."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig, Sft
from torchtitan.data.chat_data import tokenized_conversations
from torchtitan.data.chat_template import read_conversations, resolve_chat_template
from torchtitan.data.tokenizer import build_tokenizer
from torchtitan.data.vlm_dataset import source_files
from torchtitan.tools.logging import logger
from torchtitan.tools.paths import resolve_repo_path

_FORMAT = (
    'a JSONL file with one {"messages": [{"role": "system"|"user"|"assistant", "content": '
    '"..."}, ...]} object per line (docs/sft.md; example: tests/assets/chat/train.jsonl)'
)


def validate_chat(cfg: JobConfig) -> None:
    """Raise ConfigError on the first broken rule of a ``chat`` training/validation dataset."""
    t, v = cfg.training, cfg.validation
    sources = [("training", t.dataset, t.dataset_path)]
    if v.enable:
        sources.append(("validation", v.dataset, v.dataset_path))
    for section, name, path in sources:
        if name == "chat":
            _validate_source(cfg, f"{section}.dataset_path", path)
    if not any(name == "chat" for _, name, _ in sources):
        for f in dataclasses.fields(Sft):
            if getattr(cfg.sft, f.name) != f.default:
                raise ConfigError(
                    f"sft.{f.name}",
                    getattr(cfg.sft, f.name),
                    "applies only to a 'chat' dataset, and none is used",
                    "set training.dataset = 'chat' (docs/sft.md) or remove the option",
                )
    if t.dataset == "chat" and t.data_sharding != "window":
        raise ConfigError(
            "training.data_sharding",
            t.data_sharding,
            "the chat dataset always shares its rows like 'window' (row g to rank g % dp)",
            "remove it or set it to 'window' (docs/sft.md)",
        )
    if t.dataset == "chat" and cfg.sft.packing == "pack" and cfg.model.attn_mask_type == "causal":
        logger.warning(
            "sft.packing = 'pack' with model.attn_mask_type = 'causal': a conversation attends "
            "to the earlier conversations of its row; set model.attn_mask_type = "
            "'block_causal' to keep them apart (docs/sft.md)"
        )


def _validate_source(cfg: JobConfig, field: str, path: str | None) -> None:
    if not path:
        raise ConfigError(
            field, path, "a 'chat' dataset needs a file", f"set --{field} to {_FORMAT}"
        )
    file = resolve_repo_path(path)
    if not file.is_file():
        raise ConfigError(
            field,
            path,
            "is a directory, not a file"
            if file.is_dir()
            else "does not exist (looked in the working directory and the repository root)",
            f"point it at {_FORMAT}",
        )
    s = cfg.sft
    try:
        if sum(1 for _ in read_conversations(file)) == 0:  # reads (checks) every record
            raise ValueError(f"{file} holds no conversation")
        # Tokenized as the dataset will be: the overlong policy can leave nothing to train on.
        tokenizer = build_tokenizer(cfg.model.tokenizer_path)
        resolve_chat_template(tokenizer, s.chat_template)
        seq_len = cfg.training.seq_len
        convs, dropped = tokenized_conversations(
            file, tokenizer, seq_len, s.overlong, s.chat_template
        )
        if not convs:
            raise ValueError(
                f"{file}: no conversation left to train on (all {dropped} are longer than "
                f"training.seq_len {seq_len} before their first assistant token, or dropped)"
            )
    except (ValueError, OSError) as e:
        fix = f"fix the data or the option; expected {_FORMAT}"
        raise ConfigError(field, path, str(e), fix) from e


VLM_MODELS = ("qwen3_5_vl", "kimi_k25")


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
    _validate_image_tokens(cfg)
    mixed = [i for i, s in enumerate(t.mixture) if s.dataset == "vlm"]
    if t.dataset != "vlm" and not (t.dataset == "mixture" and mixed):
        return
    if importlib.util.find_spec("PIL") is None:
        raise ConfigError(
            "training.dataset",
            t.dataset,
            "image-text samples are decoded with Pillow, which this environment does not have",
            "pip install 'pillow>=10' (the project's vlm extra)",
        )
    if cfg.model.name not in VLM_MODELS:
        raise ConfigError(
            "training.dataset",
            t.dataset,
            f"image-text data needs a model with a vision tower (one of {list(VLM_MODELS)}), "
            f"not {cfg.model.name!r}",
            "set --model.name qwen3_5_vl or kimi_k25 (docs/vlm.md)",
        )
    paths = [("training.dataset_path", t.dataset_path)] if t.dataset == "vlm" else []
    paths += [(f"training.mixture[{i}].path", t.mixture[i].path) for i in mixed]
    for field, path in paths:
        try:
            source_files(Path(path or ""))
        except ValueError as e:
            raise ConfigError(
                field,
                path,
                str(e),
                "point it at .parquet files or WebDataset .tar shards (scripts/make_vlm_data.py)",
            ) from None


def _validate_image_tokens(cfg: JobConfig) -> None:
    """``training.image_tokens_per_sample``: at most ``seq_len`` (>= 0 is its value rule,
    ``validate_values.RULES``), and only for a model with a vision tower (it adds the tower's
    FLOPs to MFU: models/common/vision/flops.py)."""
    n, t = cfg.training.image_tokens_per_sample, cfg.training
    field = "training.image_tokens_per_sample"
    if n > t.seq_len:
        raise ConfigError(
            field, n, f"must be at most training.seq_len = {t.seq_len} (tokens of a sample)",
            "give the data's mean merged image tokens per sample, or 0",
        )  # fmt: skip
    if n and cfg.model.name not in VLM_MODELS:
        raise ConfigError(
            field, n, f"counts a vision tower's FLOPs, and {cfg.model.name!r} has none",
            "remove it, or train a model with a tower (--model.name qwen3_5_vl)",
        )  # fmt: skip
