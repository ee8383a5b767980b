"""The arguments of ``python -m torchtitan.convert`` checked before any process group or model
(docs/hf_io.md, docs/errors.md "Weight folders"): each problem is one ``ConfigError`` naming
the argument, the value, what is wrong and a fix; the converter prints it and exits 2.
Nothing is written by a conversion that would replace an existing model."""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path
from typing import Any

from torchtitan.checkpoint import storage as io
from torchtitan.checkpoint.hf_io import INDEX
from torchtitan.checkpoint.input_checks import check_dcp_folder
from torchtitan.config.errors import ConfigError
from torchtitan.models import MODELS
from torchtitan.preflight.validate_weights import (
    by_own_config,
    check_dcp_model,
    check_hf_files,
    check_hf_model,
    hf_family,
)

__all__ = ["check_flavor", "check_from_hf", "check_to_hf"]


def _flavor(model: str, flavor: str) -> Any:
    spec = MODELS[model]
    if flavor not in spec.flavors:
        rule = f"is not a flavor of {model}"
        raise ConfigError("--flavor", flavor, rule, f"pick one of {list(spec.flavors)}")
    return spec.flavors[flavor]


def _fresh_output(out: Path, field: str, taken: list[str]) -> None:
    """``out`` can be made a folder, and holds none of ``taken`` (what the run would write)."""
    probe = out
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        where = "is a file" if probe == out else f"is under {probe}, a file"
        raise ConfigError(field, str(out), f"{where}, not a folder", "give a new folder path")
    clash = [t for t in taken if (out / t).exists() or (t.startswith("*") and any(out.glob(t)))]
    if out.is_dir() and clash:
        rule = f"already holds {clash[0]}: converting would overwrite a model"
        raise ConfigError(field, str(out), rule, "give a new folder, or move the old one away")


def check_to_hf(a: argparse.Namespace) -> tuple[Any, int]:
    """(the flavor's args, the shard size in bytes) for ``to-hf``; the checkpoint is one
    intact DCP step folder of ``--model``/``--flavor``, the output a new folder."""
    args = _flavor(a.model, a.flavor)
    gb = a.max_shard_gb
    if not (math.isfinite(gb) and gb > 0 and int(gb * 1e9) >= 1):
        raise ConfigError("--max-shard-gb", gb, "must be a finite number > 0", "use e.g. 5")
    if a.max_seq_len is not None:
        if a.max_seq_len < 1:
            raise ConfigError("--max-seq-len", a.max_seq_len, "must be >= 1", "use e.g. 8192")
        args = dataclasses.replace(args, max_seq_len=a.max_seq_len)
    hint = "it is already a Hugging Face folder; to import it use from-hf"
    path = check_dcp_folder(a.checkpoint, "checkpoint", hint)
    if not (path / io.MANIFEST).is_file():
        rule = "has no manifest.json: a save that never finished, or not written by torchtitan"
        raise ConfigError("checkpoint", str(path), rule, "give a complete step-N folder")
    if not by_own_config(a.model):
        check_dcp_model(path, "checkpoint", a.model, a.flavor)
    _fresh_output(a.output, "output", ["config.json", INDEX, "*.safetensors"])
    return args, int(gb * 1e9)


def check_from_hf(a: argparse.Namespace) -> None:
    """``from-hf``: ``--step`` >= 0, the folder a readable Hugging Face folder of ``--model``
    (and of ``--flavor`` when given), every tensor with its shape; ``step-N`` not there yet."""
    if a.step < 0:
        raise ConfigError("--step", a.step, "must be >= 0", "use e.g. 0")
    folder = a.hf_folder
    if not folder.is_dir():
        rule = "does not exist" if not folder.exists() else "is a file, not a folder"
        fix = "give a Hugging Face model folder (config.json + *.safetensors)"
        raise ConfigError("hf_folder", str(folder), rule, fix)
    if (folder / ".metadata").is_file() or io.complete_steps(folder):
        rule = "is a DCP checkpoint, not a Hugging Face folder"
        raise ConfigError("hf_folder", str(folder), rule, "to export it use to-hf")
    step = io.step_dir(a.output, a.step)
    if by_own_config(a.model):  # the hf family: its own config.json decides (file checks)
        check_hf_files(folder, "hf_folder")
        if step.exists():
            rule = f"{step} exists: converting would replace it"
            raise ConfigError("--step", a.step, rule, "use another --step or output folder")
        return
    family, args = hf_family(folder, "hf_folder")
    if family != a.model:
        rule = f"{folder}/config.json describes a {family} model"
        raise ConfigError("--model", a.model, rule, f"use --model {family}")
    if a.flavor is not None:
        check_flavor(args, MODELS[a.model], a.flavor, folder)
    what = f"its config.json's {family} model"
    check_hf_model(folder, "hf_folder", family, args, what, fit=True)
    if step.exists():
        rule = f"{step} exists: converting would replace it"
        raise ConfigError("--step", a.step, rule, "use another --step or output folder")


def check_flavor(args: Any, spec: Any, flavor: str, folder: Path) -> None:
    """The args read from ``folder/config.json`` are ``spec``'s ``flavor`` (vocabulary and
    context length aside)."""
    if flavor not in spec.flavors:
        rule = f"is not a flavor of {spec.name}"
        raise ConfigError("--flavor", flavor, rule, f"pick one of {list(spec.flavors)}")
    want = dataclasses.replace(
        spec.flavors[flavor], vocab_size=args.vocab_size, max_seq_len=args.max_seq_len
    )
    differ = [
        f"{f.name}={getattr(args, f.name)!r} (flavor: {getattr(want, f.name)!r})"
        for f in dataclasses.fields(args)
        if getattr(args, f.name) != getattr(want, f.name) and f.name != "attn_backend"
    ]
    if differ:
        rule = f"{folder}/config.json is not --flavor {flavor}: {', '.join(differ)}"
        raise ConfigError("--flavor", flavor, rule, "drop --flavor, or give that model's folder")
