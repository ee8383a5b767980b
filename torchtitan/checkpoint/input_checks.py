"""Checks of the weight folders an entry point is given, before any process group or model
(docs/errors.md, "Weight folders"): a DCP ``step-N`` folder, a Hugging Face folder
(``config.json`` + ``*.safetensors``), a PEFT adapter folder. Each problem is one
:class:`ConfigError` naming the option (``field``), the folder or file, what is wrong and a
fix; only headers and metadata are read, never the tensors' bytes.

This module names no family: the callers (``convert.py``, ``eval/``, ``preflight/``) pass the
shapes a model expects, from the family's adapter (:func:`expected_hf_shapes`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from torchtitan.checkpoint import storage as io
from torchtitan.config.errors import ConfigError

__all__ = [
    "check_dcp_folder",
    "check_hf_tensors",
    "dcp_model_shapes",
    "expected_hf_shapes",
    "read_json",
    "safetensors_shapes",
]

Shapes = dict[str, tuple[int, ...]]
_FLOAT_CODES = {"F64", "F32", "F16", "BF16"}
_WIDTHS = {"64": 8, "32": 4, "16": 2, "F16": 2}  # by the code less its first letter


def read_json(path: Path, field: str, value: Any, fix: str) -> dict[str, Any]:
    """``path`` parsed as a JSON object, or a ConfigError naming ``field``."""
    if not path.is_file():
        raise ConfigError(field, value, f"{path} does not exist", fix)
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        why = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
        raise ConfigError(field, value, f"{path} is not valid JSON ({why})", fix) from None
    if not isinstance(data, dict):
        raise ConfigError(field, value, f"{path} is not a JSON object", fix)
    return data


def _damaged(field: str, value: Any, path: Path, why: str, fix: str) -> ConfigError:
    return ConfigError(field, value, f"{path} is not a readable safetensors file ({why})", fix)


def _header(path: Path, field: str, value: Any, fix: str) -> dict[str, Any]:
    """The JSON header of one safetensors file, checked against the file's size: a truncated
    file, a garbage header or offsets past the end are refused here."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n < 2 or 8 + n > size:
                raise _damaged(field, value, path, "truncated or not safetensors", fix)
            header = json.loads(f.read(n).decode("utf-8"))
    except OSError as e:
        raise _damaged(field, value, path, e.strerror or type(e).__name__, fix) from None
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise _damaged(field, value, path, "its header is not JSON", fix) from None
    if not isinstance(header, dict):
        raise _damaged(field, value, path, "its header is not a JSON object", fix)
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            start, stop = (int(x) for x in entry["data_offsets"])
            shape = [int(s) for s in entry["shape"]]
            code = str(entry["dtype"])
        except (TypeError, KeyError, ValueError):
            raise _damaged(field, value, path, f"entry {name!r} is malformed", fix) from None
        width = _WIDTHS.get(code[1:], 1)
        if (
            min(shape, default=0) < 0
            or not 0 <= start <= stop
            or stop - start != width * math.prod(shape)
        ):
            raise _damaged(field, value, path, f"entry {name!r} has inconsistent offsets", fix)
        end = max(end, stop)
    if 8 + n + end != size:
        raise _damaged(field, value, path, f"{size} bytes, its header says {8 + n + end}", fix)
    try:  # the library's own checks (offsets in order, no overlap, alignment)
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            f.keys()
    except Exception as e:  # noqa: BLE001 - SafetensorError and its kin: one user error
        raise _damaged(field, value, path, str(e).splitlines()[0][:120], fix) from None
    return header


def safetensors_shapes(folder: Path, field: str, value: Any, fix: str) -> Shapes:
    """Every tensor of a Hugging Face (or PEFT) folder by name -> shape, from the headers of its
    ``*.safetensors`` files (and the index, when there is one). Non-float tensors are refused
    with the file and name (our models hold float weights only)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(field, value, f"{folder} holds no *.safetensors files", fix)
    shapes: Shapes = {}
    for path in files:
        for name, entry in _header(path, field, value, fix).items():
            if name == "__metadata__":
                continue
            if entry["dtype"] not in _FLOAT_CODES:
                rule = f"{path}: {name} is {entry['dtype']}, not a float type"
                raise ConfigError(field, value, rule, fix)
            shapes[name] = tuple(int(s) for s in entry["shape"])
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json(index, field, value, fix).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ConfigError(field, value, f"{index} has no weight_map object", fix)
        for name, file in weight_map.items():
            if not isinstance(file, str) or not (folder / file).is_file() or name not in shapes:
                rule = f"{index} maps {name} to {file!r}, which does not hold it"
                raise ConfigError(field, value, rule, fix)
    return shapes


def expected_hf_shapes(adapter: Any, ours: dict[str, tuple[int, ...]]) -> Shapes:
    """The Hugging Face names and shapes the family's ``adapter`` reads for our tensors
    ``ours`` (name -> shape): its export plan, computed on the meta device."""
    out: Shapes = {}
    for key, shape in ours.items():
        if adapter.exports_nothing(key):
            continue
        meta = torch.empty(shape, device="meta")
        for hf, t in adapter.to_hf_one(key, meta, check=False):
            out[hf] = tuple(t.shape)
    return out


def check_hf_tensors(
    found: Shapes, expected: Shapes, field: str, value: Any, what: str, fix: str
) -> None:
    """Every name ``expected`` (what ``what`` needs) is in ``found`` with that shape; extra
    tensors in the folder are not read and are allowed."""
    missing = [k for k in expected if k not in found]
    if missing:
        rule = (
            f"lacks {len(missing)} of the {len(expected)} tensors {what} needs (e.g. "
            f"{missing[0]}; the folder holds e.g. {sorted(found)[:2]}): weights of another "
            "model family or a partial folder"
        )
        raise ConfigError(field, value, rule, fix)
    for name, shape in expected.items():
        if tuple(found[name]) != tuple(shape):
            rule = f"{name} is {list(found[name])} in the folder, {list(shape)} in {what}"
            raise ConfigError(field, value, rule, fix)


def check_dcp_folder(path: Path, field: str, hf_hint: str, verify_checksums: bool = True) -> Path:
    """``path`` is one complete DCP checkpoint folder (not a checkpoint root, not a Hugging
    Face folder, its manifest's files intact); returns it. ``hf_hint``: the fix when the
    folder is a Hugging Face one."""
    value = str(path)
    if not path.exists():
        raise ConfigError(field, value, "does not exist", "give a step-N checkpoint folder")
    if not path.is_dir():
        raise ConfigError(field, value, "is a file, not a folder", "give a step-N folder")
    if not (path / ".metadata").is_file():
        steps = io.complete_steps(path)
        if steps:
            shown = ", ".join(f"step-{s}" for s in steps[-4:])
            rule = f"is a checkpoint root, not one checkpoint (it holds {shown})"
            fix = f"give one of its step folders, e.g. {path / f'step-{steps[-1]}'}"
            raise ConfigError(field, value, rule, fix)
        if (path / "adapter_config.json").is_file():
            rule = "is a PEFT adapter folder, not a DCP checkpoint"
            raise ConfigError(field, value, rule, "merge it with scripts/export_lora.py first")
        if (path / "config.json").is_file() or list(path.glob("*.safetensors")):
            raise ConfigError(field, value, "is a Hugging Face folder, not a DCP one", hf_hint)
        rule = "holds no .metadata: it is not a DCP checkpoint folder"
        raise ConfigError(field, value, rule, "give a step-N folder written by training")
    if (path / io.MANIFEST).exists():
        reason = io.verify(path, verify_checksums)
        if reason is not None:
            rule = f"is damaged: {reason}"
            fix = "use another step folder (checkpoint.keep_latest_k keeps several)"
            raise ConfigError(field, value, rule, fix)
    return path


def dcp_model_shapes(path: Path, field: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The ``model`` tensors of a DCP folder (name without ``model.`` -> (shape, dtype)), from
    its ``.metadata`` through the restricted unpickler; a LoRA checkpoint (adapters only) and
    a folder without model weights are refused."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from torchtitan.checkpoint.trust import SafeFileSystemReader, UntrustedCheckpointError

    try:
        metadata = SafeFileSystemReader(str(path)).read_metadata().state_dict_metadata
    except UntrustedCheckpointError as e:
        raise ConfigError(field, str(path), str(e), "use a checkpoint you trust") from None
    except Exception as e:  # noqa: BLE001 - any unreadable .metadata is the same user error
        rule = f"its .metadata cannot be read ({type(e).__name__})"
        raise ConfigError(field, str(path), rule, "use an intact step-N folder") from None
    shapes = {
        k.removeprefix("model."): (tuple(m.size), m.properties.dtype)
        for k, m in metadata.items()
        if k.startswith("model.") and isinstance(m, TensorStorageMetadata)
    }
    if not shapes:
        rule = "holds no model weights"
        raise ConfigError(field, str(path), rule, "give a checkpoint written by training")
    if all(".lora_" in k for k in shapes):
        rule = "is a LoRA checkpoint: it holds only adapters, not a whole model"
        fix = "merge them into the base with scripts/export_lora.py and use that folder"
        raise ConfigError(field, str(path), rule, fix)
    return shapes
