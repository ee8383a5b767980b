"""Peak of live tensor memory, measured by following tensor storages (not RSS, not the allocator).

:class:`LiveTensorTracker` is a ``TorchDispatchMode``: every tensor an aten op returns has its
storage registered once (views share their base's storage), with a ``weakref.finalize`` that
removes it when the storage dies. ``UntypedStorage.resize_`` is wrapped while the tracker is
active, because FSDP2 frees and re-allocates its unsharded parameters by resizing storages in
place (no aten op is involved). The running total of registered bytes is the live tensor memory;
its maximum is the peak. Tensors that existed before the tracker started are not counted unless
registered with :meth:`LiveTensorTracker.add`.

What it cannot see: scratch memory an op allocates and frees inside its own C++ kernel, and
buffers of the communication backend. Those are what the estimator's temporaries allowance is for.

Used by the estimator's calibration test; it works on any device (CPU included), in one process
or per rank.

Excluding storages after the fact (``record=True``): every storage gets a serial number when it
is first seen, and the tracker logs each change of live bytes since the last ``reset_peak``.
:meth:`LiveTensorTracker.peak_excluding` replays that log without the given storages, so a
caller that learns only at the end of a step which storages belong to a category (e.g. the ones
FSDP's CPU offload keeps in host memory: sharded parameters, their gradients, optimizer states)
gets the peak of the rest at every moment of the step. :meth:`LiveTensorTracker.serials` names
live storages by tensor; :meth:`LiveTensorTracker.collecting` names the storages created inside
a block of code (e.g. the optimizer step).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["LiveTensorTracker"]


def _local(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding a DTensor's (or other wrapper subclass's) data."""
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t


class LiveTensorTracker(TorchDispatchMode):
    """Tracks the bytes of live tensor storages; ``peak`` is the maximum seen since ``reset_peak``."""

    def __init__(self, record: bool = False) -> None:
        super().__init__()
        self._sizes: dict[int, int] = {}  # storage key -> bytes now
        self._serial: dict[int, int] = {}  # storage key -> serial (keys are reused, serials not)
        self._next_serial = 0
        self.current = 0
        self.peak = 0
        self.record = record
        self._start: dict[int, int] = {}  # serial -> bytes live at the last reset_peak
        self._log: list[tuple[int, int]] = []  # (serial, change of bytes) since then
        self._collectors: list[set[int]] = []
        self._original_resize: Callable[..., Any] | None = None
        self._own_attr = False

    # ------------------------------------------------------------------ bookkeeping
    def _change(self, key: int, delta: int) -> None:
        self.current += delta
        if self.record and delta:
            self._log.append((self._serial[key], delta))

    def _new(self, key: int, size: int, storage: torch.UntypedStorage) -> None:
        self._sizes[key] = size
        self._serial[key] = self._next_serial
        self._next_serial += 1
        for collected in self._collectors:
            collected.add(self._serial[key])
        self._change(key, size)
        weakref.finalize(storage, self._forget, key)

    def _forget(self, key: int) -> None:
        if key in self._sizes:
            self._change(key, -self._sizes.pop(key))
            del self._serial[key]

    def _register(self, t: torch.Tensor) -> None:
        t = _local(t)
        if t.device.type == "meta" or not hasattr(t, "untyped_storage"):
            return
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # e.g. sparse or functional wrappers
            return
        key = storage._cdata
        if key not in self._sizes:
            self._new(key, storage.nbytes(), storage)

    def _observe(self) -> None:
        if self.current > self.peak:
            self.peak = self.current

    def add(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count tensors made before the tracker started (e.g. parameters)."""
        for t in tensors:
            self._register(t)
        self._observe()

    def reset_peak(self) -> None:
        """Start a new peak from the memory live now (and, recording, a new log)."""
        self.peak = self.current
        if self.record:
            self._start = {self._serial[k]: n for k, n in self._sizes.items()}
            self._log = []

    def serials(self, tensors: Iterable[torch.Tensor]) -> set[int]:
        """Serial numbers of the live, tracked storages holding ``tensors``."""
        out = set()
        for t in tensors:
            key = _local(t).untyped_storage()._cdata
            if key in self._serial:
                out.add(self._serial[key])
        return out

    @contextlib.contextmanager
    def collecting(self) -> Iterator[set[int]]:
        """Yields a set that receives the serial of every storage first seen inside the block."""
        collected: set[int] = set()
        self._collectors.append(collected)
        try:
            yield collected
        finally:
            self._collectors.remove(collected)

    def peak_excluding(self, excluded: set[int]) -> int:
        """Peak since the last ``reset_peak`` with the ``excluded`` storages not counted at any
        moment (needs ``record=True``)."""
        if not self.record:
            raise RuntimeError("peak_excluding needs LiveTensorTracker(record=True)")
        current = sum(n for s, n in self._start.items() if s not in excluded)
        peak = current
        for serial, delta in self._log:
            if serial not in excluded:
                current += delta
                peak = max(peak, current)
        return peak

    # ------------------------------------------------------------------ hooks
    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        leaves, _ = tree_flatten(out)
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                self._register(leaf)
        self._observe()
        return out

    def _resize(self, storage: torch.UntypedStorage, size: int) -> Any:
        assert self._original_resize is not None
        result = self._original_resize(storage, size)
        key = storage._cdata
        if key in self._sizes:
            delta = storage.nbytes() - self._sizes[key]
            self._sizes[key] = storage.nbytes()
            self._change(key, delta)
        elif storage.nbytes() > 0:
            self._new(key, storage.nbytes(), storage)
        self._observe()
        return result

    def __enter__(self) -> LiveTensorTracker:
        self._own_attr = "resize_" in torch.UntypedStorage.__dict__
        self._original_resize = torch.UntypedStorage.resize_
        tracker = self

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            return tracker._resize(storage, size)

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign,assignment]
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        if self._original_resize is not None:
            if self._own_attr:
                torch.UntypedStorage.resize_ = self._original_resize  # type: ignore[method-assign]
            else:
                del torch.UntypedStorage.resize_
            self._original_resize = None
