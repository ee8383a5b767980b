"""Checks of the pre-tokenized and mixture data options (docs/data.md), before any process group:
corpus folders and manifests, the tokenizer they were made with, mixture entries and weights,
and options that would otherwise be ignored."""

from __future__ import annotations

import math
from pathlib import Path

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig
from torchtitan.data.builder import is_token_corpus, source_label
from torchtitan.data.checks import check_files
from torchtitan.data.sources import Fields, local_source
from torchtitan.data.token_shards import check_manifest, read_manifest
from torchtitan.data.tokenizer import AnyTokenizer, build_tokenizer
from torchtitan.tools.paths import resolve_repo_path

__all__ = ["validate_data"]


def _check_corpus(field: str, path: str | None, tokenizer: AnyTokenizer, seq_len: int) -> None:
    fix = "run scripts/pretokenize.py --out <folder> with model.tokenizer_path, and point to it"
    if not path:
        raise ConfigError(field, path, "must name the corpus folder of a tokenized dataset", fix)
    folder = resolve_repo_path(path)
    manifest = read_manifest(folder, field)  # a CorpusError names the field and the file
    check_manifest(folder, manifest, tokenizer, field)
    if manifest["total_tokens"] < seq_len + 1:
        raise ConfigError(
            field,
            path,
            f"holds {manifest['total_tokens']} tokens, fewer than one window of "
            f"training.seq_len + 1 = {seq_len + 1}",
            "pretokenize more data or lower training.seq_len",
        )


def _validate_mixture(cfg: JobConfig, tokenizer: AnyTokenizer) -> None:
    t = cfg.training
    if not t.mixture:
        raise ConfigError(
            "training.mixture",
            [],
            'is empty but training.dataset = "mixture"',
            "add [[training.mixture]] tables with path (or dataset) and weight",
        )
    labels: dict[str, int] = {}
    for i, src in enumerate(t.mixture):
        where = f"training.mixture[{i}]"
        if not (isinstance(src.weight, float) and math.isfinite(src.weight) and src.weight > 0):
            raise ConfigError(
                f"{where}.weight", src.weight, "must be a finite number > 0", "use e.g. 1.0"
            )
        if not src.path and not src.dataset:
            raise ConfigError(where, None, "names no data", "set path (or dataset) in the table")
        if src.dataset == "vlm":  # image-text files: validate_samples.py: validate_vlm
            pass
        elif is_token_corpus(src.path):
            if src.dataset:
                raise ConfigError(
                    f"{where}.dataset",
                    src.dataset,
                    "is set for a pretokenized corpus, which has no dataset name",
                    "remove dataset from this table",
                )
            _check_corpus(f"{where}.path", src.path, tokenizer, t.seq_len)
        elif src.path and not resolve_repo_path(src.path).exists():
            raise ConfigError(
                f"{where}.path",
                src.path,
                "does not exist",
                "give a pretokenized corpus folder or local text data",
            )
        else:  # text: its files exist and their heads decode, as training.dataset_path's
            text = local_source(
                src.dataset or src.path, src.path or None, "train", Fields.mixture(i)
            )
            if text is not None:
                check_files(text)
        label = source_label(src)
        if label in labels:
            raise ConfigError(
                where,
                label,
                f"has the same name as training.mixture[{labels[label]}] (names label metrics)",
                "use distinct datasets or folder names",
            )
        labels[label] = i


def validate_data(cfg: JobConfig) -> None:
    """Raise ConfigError on the first data option that cannot work."""
    t = cfg.training
    tokenized = t.dataset == "tokenized"
    mixture = t.dataset == "mixture"
    if t.mixture and not mixture:
        raise ConfigError(
            "training.dataset",
            t.dataset,
            "is not 'mixture' but [[training.mixture]] tables are given",
            'set training.dataset = "mixture", or remove the tables',
        )
    if t.mixture_exhausted != "wrap" and not mixture:
        raise ConfigError(
            "training.mixture_exhausted",
            t.mixture_exhausted,
            'only applies to training.dataset = "mixture"',
            "remove it",
        )
    if (tokenized or mixture) and t.data_sharding != "window":
        raise ConfigError(
            "training.data_sharding",
            t.data_sharding,
            f"only applies to text datasets; {t.dataset!r} always shares windows by index",
            "remove it",
        )
    if mixture and t.dataset_path:
        raise ConfigError(
            "training.dataset_path",
            t.dataset_path,
            'is not used by training.dataset = "mixture"',
            "remove it; give each source's path in its [[training.mixture]] table",
        )
    v = cfg.validation
    if v.enable and v.dataset == "mixture":
        raise ConfigError(
            "validation.dataset",
            v.dataset,
            "cannot be a mixture",
            'use a text dataset or "tokenized" with validation.dataset_path',
        )
    uses_corpus = tokenized or (v.enable and v.dataset == "tokenized")
    any_tokenized = tokenized or any(is_token_corpus(s.path) for s in t.mixture)
    if t.tokenized_shuffle != "none" and not any_tokenized:
        raise ConfigError(
            "training.tokenized_shuffle",
            t.tokenized_shuffle,
            "only applies to pretokenized data and the training data has none",
            'remove it, or train on training.dataset = "tokenized"',
        )
    if not (uses_corpus or mixture):
        return
    tok_path = Path(cfg.model.tokenizer_path)
    if not (tok_path.is_file() or (tok_path / "tokenizer.model").is_file()):
        return  # reported by the model checks
    tokenizer = build_tokenizer(cfg.model.tokenizer_path)
    if tokenized:
        _check_corpus("training.dataset_path", t.dataset_path, tokenizer, t.seq_len)
    if v.enable and v.dataset == "tokenized":
        _check_corpus("validation.dataset_path", v.dataset_path, tokenizer, t.seq_len)
    if mixture:
        _validate_mixture(cfg, tokenizer)
