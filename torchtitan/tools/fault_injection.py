"""Test-only fault injection through ``TORCHTITAN_FAULT`` (docs/observability.md, "Fault
injection").

The variable holds ``;``-separated faults, each ``kind:key=value,...``:

- ``kill:rank=R,step=S``: rank R SIGKILLs itself at the start of step S, in the first attempt
  only (torchrun's ``TORCHELASTIC_RESTART_COUNT`` is 0 or unset), so a restart runs clean;
- ``hang:rank=R,step=S[,seconds=T]``: rank R sleeps T seconds (default 3600) at the start of
  step S, as a rank stuck outside any collective would;
- ``slow:rank=R[,seconds=T]``: rank R sleeps T seconds (default 0.2) before every batch it
  loads (a slow input pipeline);
- ``spike:step=S[,factor=F][,rank=R]``: the loss of step S (on rank R, default every rank) is
  multiplied by F (default 100) before backward, so its gradients scale too; once (a rollback
  that replays step S trains it normally). Not under pipeline parallel.
- ``full_disk:rank=R,step=S``: from the checkpoint save of step S on, rank R's checkpoint files
  meet a full disk: each file stream writes half of what it is given, then raises ``OSError``
  ENOSPC (the partial file stays, as on a real full disk);
- ``mkdir_error:step=S[,errno=E]``: from the save of step S on, rank 0's creation of
  ``step-N.tmp`` fails with ``OSError`` E (default 28, ENOSPC; 13 is EACCES).

Unset (the normal case) every hook is a dictionary lookup that finds nothing.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchtitan.tools.logging import logger

__all__ = ["Faults", "parse_faults"]

ENV = "TORCHTITAN_FAULT"
_KINDS = {"kill", "hang", "slow", "spike", "full_disk", "mkdir_error"}


@dataclass
class Faults:
    rank: int
    specs: dict[str, dict[str, float]] = field(default_factory=dict)
    spiked: bool = False  # the spike fires once (a rollback replays its step)

    def _mine(self, kind: str) -> dict[str, float] | None:
        spec = self.specs.get(kind)
        if spec is None or int(spec.get("rank", self.rank)) != self.rank:
            return None
        return spec

    def at_step_start(self, step: int) -> None:
        kill = self._mine("kill")
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if kill is not None and int(kill["step"]) == step and first_attempt:
            logger.warning(f"fault injection: SIGKILL at the start of step {step}")
            os.kill(os.getpid(), signal.SIGKILL)
        hang = self._mine("hang")
        if hang is not None and int(hang["step"]) == step:
            logger.warning(f"fault injection: hanging at the start of step {step}")
            time.sleep(hang.get("seconds", 3600.0))

    def before_batch(self) -> None:
        slow = self._mine("slow")
        if slow is not None:
            time.sleep(slow.get("seconds", 0.2))

    def loss_factor(self, step: int) -> float:
        spike = self._mine("spike")
        if spike is not None and int(spike["step"]) == step and not self.spiked:
            self.spiked = True
            return float(spike.get("factor", 100.0))
        return 1.0

    def checkpoint_writer(self, step: int, folder: Path) -> Any:
        """The DCP storage writer for the save of ``step`` into ``folder``: None (DCP's own) unless
        ``full_disk`` applies to this rank and step."""
        spec = self._mine("full_disk")
        if spec is None or step < int(spec["step"]):
            return None
        logger.warning(f"fault injection: the disk is full for the save of step {step}")
        return _full_disk_writer(folder)

    def before_checkpoint_mkdir(self, step: int) -> None:
        """Rank 0, before it creates ``step-N.tmp``: raise the ``mkdir_error`` if it applies."""
        spec = self.specs.get("mkdir_error")
        if self.rank == 0 and spec is not None and step >= int(spec["step"]):
            code = int(spec.get("errno", errno.ENOSPC))
            logger.warning(f"fault injection: creating the folder of step {step} fails ({code})")
            raise OSError(code, os.strerror(code))


class _HalfWrite:
    """A file stream whose ``write`` writes half of what it is given, then finds the disk full."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def write(self, data: Any) -> int:
        self.inner.write(bytes(data)[: max(1, len(data) // 2)])
        self.inner.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _full_disk_writer(folder: Path) -> Any:
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import FileSystem

    class FullDisk(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
            with super().create_stream(path, mode) as stream:
                yield _HalfWrite(stream) if "w" in mode else stream

    writer = FileSystemWriter(str(folder))
    writer.fs = FullDisk()
    return writer


def parse_faults(rank: int, text: str | None = None) -> Faults:
    """The faults of ``TORCHTITAN_FAULT`` (or ``text``) for ``rank``."""
    text = os.environ.get(ENV, "") if text is None else text
    specs: dict[str, dict[str, float]] = {}
    for item in filter(None, (s.strip() for s in text.split(";"))):
        kind, _, args = item.partition(":")
        if kind not in _KINDS:
            raise ValueError(f"{ENV}: unknown fault {kind!r} in {text!r}; kinds: {sorted(_KINDS)}")
        spec: dict[str, float] = {}
        for pair in filter(None, args.split(",")):
            key, _, value = pair.partition("=")
            spec[key.strip()] = float(value)
        if kind not in ("slow",) and "step" not in spec:
            raise ValueError(f"{ENV}: fault {item!r} needs step=S")
        if kind in ("kill", "hang", "slow", "full_disk") and "rank" not in spec:
            raise ValueError(f"{ENV}: fault {item!r} needs rank=R")
        specs[kind] = spec
    if specs:
        logger.warning(f"fault injection on ({ENV}={text!r}): for tests only")
    return Faults(rank, specs)
