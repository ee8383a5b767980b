"""Hugging Face safetensors folders streamed rank by rank (docs/hf_io.md).

Import (:func:`load_hf_streaming`): every rank opens the ``*.safetensors`` files lazily
(``safe_open``/``get_slice``) and, for each tensor of its model parts, computes the global box
it holds (a DTensor's ``device_mesh``/``placements``; the whole tensor for a plain one; a
pipeline stage only has its layers) and asks the family's adapter for that box: the adapter
reads only the source bytes the box needs (``models/common/hf/``). Peak host memory: the
rank's shard plus one box.

Export (:func:`save_hf_streaming`): each tensor is assembled whole (``full_tensor``, one at a
time, a collective of the ranks holding it) and written by one rank, the lowest holding it,
into files that rank owns; file names, sizes and the index are planned from shapes before any
byte moves, so every writer streams its files sequentially (:class:`SafetensorsWriter`) and
nothing holds more than one full tensor. ``SafetensorsWriter`` writes the documented format
(8-byte header length, JSON header, raw little-endian bytes); files are read back with the
``safetensors`` library.

The library stays the model's: this module names no family; the adapter is duck-typed
(``from_hf_box``, ``to_hf_one``).
"""

from __future__ import annotations

import json
import os
import queue
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from torchtitan.tools.logging import logger

INDEX = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 5 * 10**9
_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
Box = tuple[slice, ...]


class SafetensorsFolder:
    """The tensors of a Hugging Face folder by name, opened lazily; counts the bytes read."""

    def __init__(self, folder: Path) -> None:
        from safetensors import safe_open

        self._open_file = lambda p: safe_open(str(p), framework="pt")
        index = folder / INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._where = {k: folder / v for k, v in weight_map.items()}
        else:
            files = sorted(folder.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"{folder} holds no *.safetensors files")
            self._where = {k: f for f in files for k in self._open_file(f).keys()}  # noqa: SIM118
        self._handles: dict[Path, Any] = {}
        self.bytes_read = 0

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def names(self) -> list[str]:
        return list(self._where)

    def _slice(self, name: str) -> Any:
        path = self._where[name]
        if path not in self._handles:
            self._handles[path] = self._open_file(path)
        return self._handles[path].get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        code = self._slice(name).get_dtype()
        return next(d for d, c in _DTYPES.items() if c == code)

    def read(self, name: str, box: Box) -> torch.Tensor:
        t: torch.Tensor = self._slice(name)[box]
        self.bytes_read += t.numel() * t.element_size()
        return t

    def release(self) -> None:
        """Close the files: ``safe_open`` maps a file, and every page read from it counts in
        this process's RSS while it stays mapped; releasing after each tensor keeps the peak at
        the shard plus one tensor (docs/hf_io.md)."""
        self._handles.clear()

    close = release


def owned_box(t: torch.Tensor) -> tuple[tuple[int, ...], Box, torch.Tensor]:
    """(global shape, the global box this rank holds, the local tensor holding it)."""
    shape = tuple(t.shape)
    if not isinstance(t, DTensor):
        return shape, tuple(slice(0, n) for n in shape), t
    local_shape, offset = compute_local_shape_and_global_offset(
        t.shape, t.device_mesh, t.placements
    )
    local = t.to_local()
    if tuple(local.shape) != tuple(local_shape):
        raise RuntimeError(f"local shard {tuple(local.shape)} is not the box {local_shape}")
    return shape, tuple(slice(o, o + n) for o, n in zip(offset, local_shape)), local


@dataclass
class Progress:
    """Bytes moved and a ``GB/s`` line at most every ``every`` seconds (``verbose``)."""

    what: str
    total: int
    verbose: bool = False
    every: float = 5.0
    done: int = 0
    t0: float = field(default_factory=time.perf_counter)
    _last: float = 0.0

    def add(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.perf_counter()
        if self.verbose and (now - self._last >= self.every or self.done >= self.total):
            self._last = now
            print(f"{self.what}: {self.line()}", flush=True)

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.t0

    def line(self) -> str:
        s = self.seconds
        rate = self.done / s / 1e9 if s > 0 else 0.0
        return f"{self.done / 1e9:.2f}/{self.total / 1e9:.2f} GB in {s:.1f} s ({rate:.2f} GB/s)"


def load_hf_streaming(
    parts: list[nn.Module], adapter: Any, folder: Path, verbose: bool = False
) -> Progress:
    """Fill the (possibly sharded) parameters of ``parts`` from the Hugging Face ``folder``,
    each rank reading only the bytes of its boxes; returns this rank's byte count and time.
    A part whose checkpoints hold only some entries (``checkpoint_keys``: LoRA adapters) takes
    the others, its base, from the folder."""
    return load_hf_state_dict(base_state_dict(parts), adapter, folder, verbose)


def base_state_dict(parts: list[nn.Module]) -> dict[str, Any]:
    """The entries of ``parts`` a Hugging Face folder holds: all, less a part's
    ``checkpoint_keys`` (the adapters, saved in our checkpoints instead)."""
    sd: dict[str, Any] = {}
    for part in parts:
        own = get_model_state_dict(part)
        ours = getattr(part, "checkpoint_keys", None)
        sd.update({k: v for k, v in own.items() if not ours(k)} if callable(ours) else own)
    return sd


def load_hf_state_dict(
    sd: dict[str, torch.Tensor], adapter: Any, folder: Path, verbose: bool = False
) -> Progress:
    """Fill the tensors of ``sd`` (our names; DTensors or plain) in place from ``folder``."""
    source = SafetensorsFolder(folder)
    check = getattr(adapter, "check_source", None)  # e.g. layers the model needs are absent
    if check is not None:
        check(source, folder)
    # A tied head shares the embedding's storage (read once), or is a copy of its box.
    unique: dict[tuple[int, tuple[int, ...]], tuple[str, torch.Tensor]] = {}
    for key, t in sd.items():
        local = owned_box(t)[2]
        unique.setdefault((local.data_ptr(), tuple(local.shape)), (key, t))
    total = sum(owned_box(t)[2].nbytes for _, t in unique.values())
    progress = Progress("import", total, verbose)
    done: dict[str, torch.Tensor] = {}
    try:
        with torch.no_grad():
            for key, t in unique.values():
                same = done.get(adapter.tied_to(key) or "")
                if same is not None and owned_box(same)[1] == owned_box(t)[1]:
                    owned_box(t)[2].copy_(owned_box(same)[2])
                else:
                    load_one(adapter, source, key, t)
                    source.release()
                done[key] = t
                progress.add(owned_box(t)[2].nbytes)
    finally:
        progress.done = source.bytes_read
        source.close()
    return progress


def load_one(adapter: Any, source: Any, key: str, t: torch.Tensor) -> None:
    """Copy this rank's box of ``key`` from ``source`` into ``t`` (a DTensor or plain)."""
    shape, box, local = owned_box(t)
    data = adapter.from_hf_box(key, shape, box, source)
    if tuple(data.shape) != tuple(local.shape):
        raise RuntimeError(f"{key}: read {tuple(data.shape)} for a shard of {tuple(local.shape)}")
    local.copy_(data)


# ---------------------------------------------------------------- export
class SafetensorsWriter:
    """One ``.safetensors`` file written front to back: the header from the planned
    ``(name, dtype, shape)`` entries, then each tensor's bytes in that order."""

    def __init__(self, path: Path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> None:
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, dtype, shape in entries:
            nbytes = _nbytes(dtype, shape)
            header[name] = {
                "dtype": _DTYPES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.path, self._order = path, [(n, d, s) for n, d, s in entries]
        self._file = open(path, "wb")  # noqa: SIM115 - closed by close()
        self._file.write(struct.pack("<Q", len(raw)) + raw)
        self._next = 0

    def write(self, name: str, t: torch.Tensor) -> int:
        want, dtype, shape = self._order[self._next]
        if (name, t.dtype, tuple(t.shape)) != (want, dtype, shape):
            raise RuntimeError(
                f"{self.path.name}: got {name} {t.dtype} {tuple(t.shape)}, "
                f"planned {want} {dtype} {shape}"
            )
        data = t.detach().contiguous().reshape(-1).view(torch.uint8)
        self._file.write(data.numpy().data)
        self._next += 1
        return data.numel()

    @property
    def complete(self) -> bool:
        return self._next == len(self._order)

    def close(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * torch.empty((), dtype=dtype).element_size()


def _gather(obj: Any, group: Any) -> list[Any]:
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _plan_files(
    planned: list[tuple[str, torch.dtype, tuple[int, ...]]], max_bytes: int
) -> list[list[tuple[str, torch.dtype, tuple[int, ...]]]]:
    files: list[list[tuple[str, torch.dtype, tuple[int, ...]]]] = []
    size = 0
    for entry in planned:
        nbytes = _nbytes(entry[1], entry[2])
        if not files or (files[-1] and size + nbytes > max_bytes):
            files.append([])
            size = 0
        files[-1].append(entry)
        size += nbytes
    return files


def save_hf_streaming(
    sd: dict[str, torch.Tensor],
    adapter: Any,
    out: Path,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    group: Any = None,
    verbose: bool = False,
    fetch: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
) -> Progress:
    """Write ``sd`` (our names; DTensors or plain; the same keys in the same order on every
    rank holding them) as a sharded Hugging Face folder ``out`` plus ``config.json``, without
    gathering the model anywhere; returns this rank's bytes written and time. With ``fetch``
    (one process), ``sd`` may hold ``meta`` tensors: each full tensor is ``fetch(key, t)``,
    made only when it is written (``scripts/export_lora.py --merged`` streams a base this way)."""
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    writer_of = _assign_writers(_gather([(k, t.numel()) for k, t in sd.items()], group))
    mine = [k for k in sd if writer_of[k] == rank]
    planned = [
        (hf, dtype or sd[k].dtype, tuple(w.shape))
        for k in mine
        for hf, w in adapter.to_hf_one(k, torch.empty(sd[k].shape, device="meta"), check=False)
    ]
    files = _plan_files(planned, max_shard_bytes)
    counts = _gather(len(files), group)
    first, n_files = sum(counts[:rank]), sum(counts)
    names = [f"model-{first + i + 1:05d}-of-{n_files:05d}.safetensors" for i in range(len(files))]
    weight_maps = _gather({e[0]: n for f, n in zip(files, names) for e in f}, group)
    sizes = _gather(sum(_nbytes(d, s) for _, d, s in planned), group)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        _write_index(out, weight_maps, sum(sizes))
        config = adapter.hf_config(dtype or next(iter(sd.values())).dtype)
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if dist.is_initialized():
        dist.barrier(group=group)
    progress = Progress("export", sizes[rank], verbose)
    # A background thread writes while the next tensor is gathered; the queue holds one tensor.
    pending: queue.Queue[tuple[str, torch.Tensor] | None] = queue.Queue(maxsize=1)
    writer = threading.Thread(
        target=_write_files, args=(pending, [(out / n, f) for n, f in zip(names, files)], progress)
    )
    writer.start()
    try:
        for key, t in sd.items():
            if adapter.exports_nothing(key):
                continue
            full = _assemble(t, writer_of[key]) if fetch is None else fetch(key, t)
            if full is not None:
                for hf, w in adapter.to_hf_one(key, full):
                    pending.put((hf, w.to(dtype) if dtype is not None else w))
    finally:
        pending.put(None)
        writer.join()
    if progress.done != sizes[rank]:
        raise RuntimeError(f"export: wrote {progress.done} bytes of {sizes[rank]} (see above)")
    if dist.is_initialized():
        dist.barrier(group=group)
    return progress


def _assemble(t: torch.Tensor, writer: int) -> torch.Tensor | None:
    """The full tensor on the rank ``writer`` (None elsewhere): gathered to it alone when
    ``t`` is ``Shard(0)`` on a 1-D mesh (FSDP's and the converter's layout), else by
    ``full_tensor`` (every holder assembles it; the others drop it)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if not isinstance(t, DTensor):
        return t if rank == writer else None
    mesh = t.device_mesh
    if mesh.ndim != 1 or type(t.placements[0]) is not Shard or t.placements[0].dim != 0:
        full = t.full_tensor()
        return full if rank == writer else None
    n, rows = mesh.size(), t.shape[0]
    chunk = -(-rows // n)
    _, box, local = owned_box(t)
    if box[0].start != min(mesh.get_local_rank() * chunk, rows):
        raise RuntimeError(f"unexpected Shard(0) layout: rows {box[0]} of {rows}")
    padded = local.new_zeros((chunk, *t.shape[1:]))
    padded[: local.shape[0]] = local
    chunks = [torch.empty_like(padded) for _ in range(n)] if rank == writer else None
    dist.gather(padded, chunks, dst=writer, group=mesh.get_group())
    return torch.cat(chunks)[:rows] if chunks is not None else None


def _assign_writers(held: list[list[tuple[str, int]]]) -> dict[str, int]:
    """Each name to one rank holding it, balancing the elements each rank writes (the same
    answer on every rank: it is computed from the gathered lists)."""
    holders: dict[str, list[int]] = {}
    sizes: dict[str, int] = {}
    for r, names in enumerate(held):
        for name, n in names:
            holders.setdefault(name, []).append(r)
            sizes[name] = n
    load = [0] * len(held)
    writer_of: dict[str, int] = {}
    for name, ranks in holders.items():
        writer_of[name] = min(ranks, key=lambda r: (load[r], r))
        load[writer_of[name]] += sizes[name]
    return writer_of


def _write_files(
    pending: queue.Queue[tuple[str, torch.Tensor] | None],
    files: list[tuple[Path, list[tuple[str, torch.dtype, tuple[int, ...]]]]],
    progress: Progress,
) -> None:
    """The writer thread: fills the planned files in order from ``pending`` until None."""
    todo = iter(files)
    current: SafetensorsWriter | None = None
    error: BaseException | None = None
    while (item := pending.get()) is not None:
        if error is not None:
            continue  # drain, so the producer never blocks; reported by the byte count
        try:
            if current is None or current.complete:
                if current is not None:
                    current.close()
                current = SafetensorsWriter(*next(todo))
            progress.add(current.write(*item))
        except BaseException as e:  # noqa: BLE001 - logged; the caller checks the bytes
            logger.error(f"export: writing {item[0]} failed: {e!r}")
            error = e
    if current is not None:
        current.close()


def _write_index(out: Path, weight_maps: list[dict[str, str]], total: int) -> None:
    weight_map: dict[str, str] = {}
    for part in weight_maps:
        weight_map.update(part)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def log_rate(what: str, progress: Progress, folder: Path) -> None:
    logger.info(f"checkpoint: {what} {folder}: {progress.line()} on this rank")
