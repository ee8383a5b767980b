"""Loading a checkpoint executes no code from it (docs/checkpoint.md, "Trust model").

Three things in a DCP folder go through Python's unpickler, and each is closed here:

- ``.metadata``, DCP's index of the folder, is a pickle. :class:`SafeFileSystemReader` reads it
  with :class:`MetadataUnpickler`, which admits only the types DCP writes there (its metadata
  dataclasses, ``torch.Size``, dtypes, layouts, paths); any other global, e.g. ``os.system``
  named by a crafted ``__reduce__``, raises :class:`UntrustedCheckpointError` before it is
  called.
- Non-tensor entries (the optimizer's ``param_groups``: floats, tuples, names) are saved by
  DCP with ``torch.save`` and read back with ``torch.load(weights_only=False)``.
  :class:`SafeLoadPlanner` first loads the same bytes with ``weights_only=True`` (torch's
  restricted unpickler: containers, numbers, strings, tensors); bytes that need anything else
  are refused.
- Our own state (RNG, LR schedule, train state, data position) is stored as JSON text in a
  ``uint8`` tensor (:func:`encode_state` / :func:`decode_state`): tensors are read with
  ``weights_only=True`` and the JSON is parsed, never unpickled.
"""

from __future__ import annotations

import base64
import io
import json
import pathlib
import pickle
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

__all__ = [
    "MetadataUnpickler",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "UntrustedCheckpointError",
    "decode_state",
    "encode_state",
]

# Modules whose classes DCP writes into ``.metadata`` (dataclasses and one enum: constructing
# them runs no code of the checkpoint's choosing).
_DCP_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.filesystem",
    "torch.distributed.checkpoint.planner",
)
_OTHER = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
}


class UntrustedCheckpointError(RuntimeError):
    """A checkpoint file asks the unpickler for something outside DCP's own types."""


class MetadataUnpickler(pickle.Unpickler):
    """An unpickler for DCP's ``.metadata`` that resolves only DCP's own types."""

    def find_class(self, module: str, name: str) -> Any:
        if module in _DCP_MODULES and not name.startswith("__"):
            obj = super().find_class(module, name)
            if isinstance(obj, type):
                return obj
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        elif (module, name) in _OTHER:
            return super().find_class(module, name)
        raise UntrustedCheckpointError(
            f"the checkpoint's .metadata asks for {module}.{name}, which is not one of DCP's "
            "metadata types: refusing to unpickle it (a crafted or foreign file). Load only "
            "checkpoints you trust (docs/checkpoint.md, 'Trust model')"
        )


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``read_metadata`` uses :class:`MetadataUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        get_path = getattr(self, "_get_metadata_path", None)
        if get_path is not None:
            path = get_path(kwargs.get("rank"))
        else:  # older layouts of FileSystemReader: one .metadata in the folder
            path = pathlib.Path(str(self.path)) / ".metadata"
        with self.fs.create_stream(path, "rb") as f:
            try:
                metadata = MetadataUnpickler(f).load()
            except UntrustedCheckpointError:
                raise
            except Exception as e:  # truncated, bit-flipped or crafted: never a traceback
                raise UntrustedCheckpointError(
                    f"{path} is not a readable DCP .metadata ({type(e).__name__}: {e}); "
                    "the checkpoint is damaged or was not written by DCP"
                ) from None
        if not isinstance(metadata, Metadata):
            raise UntrustedCheckpointError(
                f"{path} holds a {type(metadata).__name__}, not DCP Metadata"
            )
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is None:
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = getattr(self, "load_id", None)
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that refuses non-tensor entries needing more than
    ``torch.load(weights_only=True)`` admits."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        start = value.tell()
        try:
            torch.load(value, weights_only=True)
        except pickle.UnpicklingError:
            raise UntrustedCheckpointError(
                f"checkpoint entry {read_item.dest_index.fqn} needs more than plain data to "
                "load (torch.load with weights_only=True refuses it): refusing it. Load only "
                "checkpoints you trust (docs/checkpoint.md, 'Trust model')"
            ) from None
        # The same bytes passed the restricted unpickler, so the full one can only rebuild
        # the same plain data; the base class then files it where it belongs.
        value.seek(start)
        super().load_bytes(read_item, value)


# ---------------------------------------------------------------- our state as JSON
def _to_json(obj: Any) -> Any:
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {k: _to_json(v) for k, v in obj.items()}
        return {"__items__": [[_to_json(k), _to_json(v)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [_to_json(v) for v in obj]}
    if isinstance(obj, list):
        return [_to_json(v) for v in obj]
    if isinstance(obj, (bytes, bytearray)):
        return {"__bytes__": base64.b64encode(bytes(obj)).decode()}
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {
            "__tensor__": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
            "data": base64.b64encode(raw).decode(),
        }
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, np.generic):  # numpy scalars: their Python value
        return obj.item()
    if isinstance(obj, np.ndarray):
        return {"__ndarray__": _to_json(torch.from_numpy(np.ascontiguousarray(obj)))}
    raise TypeError(f"cannot store a {type(obj).__name__} in a checkpoint as JSON")


def _from_json(obj: Any) -> Any:
    if isinstance(obj, list):
        return [_from_json(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__items__" in obj:
        return {_from_json(k): _from_json(v) for k, v in obj["__items__"]}
    if "__tuple__" in obj:
        return tuple(_from_json(v) for v in obj["__tuple__"])
    if "__ndarray__" in obj:
        return _from_json(obj["__ndarray__"]).numpy()
    if "__bytes__" in obj:
        return base64.b64decode(obj["__bytes__"])
    if "__tensor__" in obj:
        dtype = getattr(torch, obj["__tensor__"])
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"not a dtype: {obj['__tensor__']}")
        raw = bytearray(base64.b64decode(obj["data"]))
        flat = (
            torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        )
        return flat.view(dtype).reshape(obj["shape"]).clone()
    return {k: _from_json(v) for k, v in obj.items()}


def encode_state(obj: Any) -> torch.Tensor:
    """``obj`` (dicts, lists, tuples, numbers, strings, bytes, tensors) as JSON in a uint8 tensor."""
    text = json.dumps(_to_json(obj), separators=(",", ":"))
    return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8).clone()


def decode_state(t: torch.Tensor) -> Any:
    """The inverse of :func:`encode_state`: JSON is parsed, nothing is unpickled."""
    return _from_json(json.loads(bytes(t.cpu().numpy().tobytes()).decode()))
