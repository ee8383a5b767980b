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
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
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

    def __init__(self) -> None:
        super().__init__()
        self._sizes: dict[int, int] = {}  # storage key -> bytes now
        self.current = 0
        self.peak = 0
        self._original_resize: Callable[..., Any] | None = None
        self._own_attr = False

    # ------------------------------------------------------------------ bookkeeping
    def _forget(self, key: int) -> None:
        self.current -= self._sizes.pop(key, 0)

    def _register(self, t: torch.Tensor) -> None:
        t = _local(t)
        if t.device.type == "meta" or not hasattr(t, "untyped_storage"):
            return
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # e.g. sparse or functional wrappers
            return
        key = storage._cdata
        if key in self._sizes:
            return
        size = storage.nbytes()
        self._sizes[key] = size
        self.current += size
        weakref.finalize(storage, self._forget, key)

    def _observe(self) -> None:
        if self.current > self.peak:
            self.peak = self.current

    def add(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count tensors made before the tracker started (e.g. parameters)."""
        for t in tensors:
            self._register(t)
        self._observe()

    def reset_peak(self) -> None:
        """Start a new peak from the memory live now."""
        self.peak = self.current

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
            self.current += storage.nbytes() - self._sizes[key]
            self._sizes[key] = storage.nbytes()
        elif storage.nbytes() > 0:
            self._sizes[key] = storage.nbytes()
            self.current += storage.nbytes()
            weakref.finalize(storage, self._forget, key)
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
