"""Paths checked before launch (part of ``validate_config``): the dump folder can be created and
written, the tokenizer decodes, dataset files exist and their first record decodes, and the
checkpoint a run is told to load exists, and the weights it starts from (``initial_load_path``,
``lora.adapter_path``) fit its model (``validate_weights.py``). Each failure is a ConfigError naming the field."""

from __future__ import annotations

import os
from pathlib import Path

from torchtitan.checkpoint.storage import complete_steps
from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig
from torchtitan.data.builder import DATASET_KINDS
from torchtitan.data.checks import check_files
from torchtitan.data.sources import Fields, local_source
from torchtitan.data.tokenizer import _TRAIN_HINT, build_tokenizer
from torchtitan.preflight.validate_weights import validate_initial_load


def validate_paths(cfg: JobConfig) -> None:
    """Dump folder, tokenizer, datasets, checkpoint load step (in that order)."""
    validate_dump_folder(cfg.job.dump_folder)
    for field, sub in (
        ("checkpoint.folder", cfg.checkpoint.folder),
        ("metrics.save_tb_folder", cfg.metrics.save_tb_folder),
        ("profiling.save_traces_folder", cfg.profiling.save_traces_folder),
        ("profiling.save_memory_snapshot_folder", cfg.profiling.save_memory_snapshot_folder),
        ("compile.cache_dir", cfg.compile.cache_dir),
    ):
        if sub:  # relative to the dump folder (an absolute path replaces it)
            validate_dump_folder(str(Path(cfg.job.dump_folder) / sub), field, sub)
    validate_tokenizer(cfg.model.tokenizer_path)
    _validate_dataset("training", cfg.training.dataset, cfg.training.dataset_path, "train")
    if cfg.validation.enable:
        _validate_dataset(
            "validation", cfg.validation.dataset, cfg.validation.dataset_path, "validation"
        )
    ck = cfg.checkpoint
    if ck.enable and ck.load_step >= 0:
        root = Path(cfg.job.dump_folder) / ck.folder
        steps = complete_steps(root)
        if ck.load_step not in steps:
            raise ConfigError(
                "checkpoint.load_step",
                ck.load_step,
                f"{root} holds no complete step-{ck.load_step} checkpoint (complete steps: "
                f"{steps or 'none'})",
                "use one of those steps, or -1 for the newest valid one",
            )
    # the weights a run starts from, against the run's model (validate_weights.py)
    validate_initial_load(cfg)  # lora.adapter_path's files: validate_lora


def validate_dump_folder(
    folder: str, field: str = "job.dump_folder", shown: str | None = None
) -> None:
    """``folder`` is a directory (or can be made one) that this user can write; errors name
    ``field`` with the value ``shown`` (default: ``folder``)."""
    shown = folder if shown is None else shown
    if not folder.strip():
        raise ConfigError(field, folder, "must not be empty", "use e.g. ./outputs")
    path = Path(folder).expanduser()
    probe = path
    while not probe.exists():  # the nearest existing ancestor decides
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        what = f"{path} is a regular file" if probe == path else f"{path} is under {probe}, a file"
        if probe == path and field == "job.dump_folder":
            what = "is a regular file"
        raise ConfigError(field, shown, f"{what}, not a folder", "give a folder path")
    if probe.exists() and not os.access(probe, os.W_OK | os.X_OK):
        where = "" if probe == path else f" ({probe} is the nearest existing folder)"
        raise ConfigError(
            field, shown, f"is not writable by this user{where}", "give a folder you can write"
        )


def validate_tokenizer(path: str) -> None:
    """The tokenizer loads and round-trips a sentence."""
    try:
        tok = build_tokenizer(path)
        text = "The quick brown fox, 1234."
        ids = tok.encode(text, bos=False, eos=False)
        ok = tok.decode(ids) == text
    except (OSError, ValueError) as e:
        why = str(e).replace(_TRAIN_HINT, "").replace(f"model.tokenizer_path={path!r} ", "")
        why = why.strip().rstrip(".")
        raise ConfigError(
            "model.tokenizer_path",
            path,
            f"cannot be loaded as a tokenizer: {why}",
            "point it at a tiktoken ranks file (or a folder with tokenizer.model), e.g. "
            "tests/assets/tokenizer, or train one with scripts/train_tokenizer.py",
        ) from None
    if not ok:
        raise ConfigError(
            "model.tokenizer_path",
            path,
            "does not round-trip text (decode(encode(s)) != s)",
            "rebuild it with scripts/train_tokenizer.py",
        )


def _validate_dataset(section: str, dataset: str, dataset_path: str | None, split: str) -> None:
    """Local data: the files exist and their heads decode (DataError names file and line). A hub
    dataset is not opened here (that needs the network or the cache, and a dataset's config
    name); when it cannot be opened the trainer reports it as one message (DataError), before
    any training step. Pre-tokenized corpora, mixtures and chat data have their own checks
    (validate_data.py, validate_samples.py)."""
    if dataset in DATASET_KINDS or dataset in ("chat", "vlm"):  # vlm: validate_samples.py
        return
    source = local_source(dataset, dataset_path, split, Fields.of(section))  # DataError if missing
    if source is not None:
        check_files(source)
