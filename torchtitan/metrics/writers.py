"""Where logged scalars go: a JSONL file, TensorBoard and Weights & Biases.

Every writer takes the same flat ``{name: value}`` dict once per log step. ``None`` means "not known at this
step" (e.g. ``mfu`` on a device without a known peak): JSONL writes it as ``null`` so every line has the same
keys; TensorBoard and W&B skip it, so no placeholder number ever appears in a plot.

Layout under ``job.dump_folder`` (see ``build_writers``)::

    <dump>/metrics/rank_<r>.jsonl          one JSON object per log step
    <dump>/<tb_folder>/rank_<r>/           TensorBoard event files
    <dump>/wandb/                          W&B run files (offline runs: <dump>/wandb/offline-run-*)
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from torchtitan.tools.logging import logger

__all__ = ["MetricWriter", "JsonlWriter", "TensorBoardWriter", "WandbWriter", "build_writers"]

Metrics = dict[str, float | int | None]


@runtime_checkable
class MetricWriter(Protocol):
    def log(self, metrics: Metrics, step: int) -> None: ...

    def close(self) -> None: ...


def _as_number(value: Any) -> float | int | None:
    """A plain Python number (bools and ints stay ints; tensors/numpy scalars become floats)."""
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if hasattr(value, "item"):  # 0-d tensor or numpy scalar
        value = value.item()
        return value if isinstance(value, (int, float)) else float(value)
    return float(value)


class JsonlWriter:
    """Appends ``{"step": step, **metrics}`` as one JSON line per ``log`` call, flushed immediately.

    The file is opened in append mode, so a resumed run continues the same file; steps between the last
    checkpoint and a crash then appear twice (readers should keep the last line for a step). ``None`` and
    non-finite floats (NaN, inf) are written as ``null``, so every line is strict JSON.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())

    def log(self, metrics: Metrics, step: int) -> None:
        record: dict[str, Any] = {"step": int(step)}
        for key, value in metrics.items():
            number = _as_number(value)
            if isinstance(number, float) and not math.isfinite(number):
                number = None
            record[key] = number
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


class TensorBoardWriter:
    """Scalars to TensorBoard event files in ``log_dir`` (``None`` values skipped), flushed each call."""

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = str(log_dir)
        os.makedirs(self.log_dir, exist_ok=True)
        self._writer: Any = SummaryWriter(log_dir=self.log_dir)

    def log(self, metrics: Metrics, step: int) -> None:
        for key, value in metrics.items():
            number = _as_number(value)
            if number is not None:
                self._writer.add_scalar(key, number, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _wandb_mode() -> str:
    """``WANDB_MODE`` if set; otherwise offline unless an API key is configured (never needs the network
    by surprise)."""
    mode = os.environ.get("WANDB_MODE")
    if mode:
        return mode
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


class WandbWriter:
    """Scalars to a Weights & Biases run (``None`` values skipped).

    ``run_dir`` is passed to ``wandb.init(dir=...)``; W&B puts its files in ``<run_dir>/wandb/``. The mode is
    ``WANDB_MODE`` when set, else ``offline`` when ``WANDB_API_KEY`` is unset (sync later with
    ``wandb sync <run_dir>/wandb/offline-run-*``), else ``online``.
    """

    def __init__(
        self,
        project: str,
        run_dir: str | os.PathLike[str],
        config: dict[str, Any] | None = None,
        name: str | None = None,
    ) -> None:
        import wandb

        self.run_dir = str(run_dir)
        os.makedirs(self.run_dir, exist_ok=True)
        self.mode = _wandb_mode()
        self._run: Any = wandb.init(
            project=project,
            dir=self.run_dir,
            config=config,
            name=name,
            mode=self.mode,  # type: ignore[arg-type]
        )

    def log(self, metrics: Metrics, step: int) -> None:
        if self._run is None:
            return
        values = {}
        for key, value in metrics.items():
            number = _as_number(value)
            if number is not None:
                values[key] = number
        self._run.log(values, step=step)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


def build_writers(
    dump_folder: str,
    *,
    enable_jsonl: bool,
    enable_tensorboard: bool,
    enable_wandb: bool,
    tb_folder: str,
    rank: int,
    write_this_rank: bool,
    config_dict: dict[str, Any] | None,
    run_name: str | None,
) -> list[MetricWriter]:
    """The writers this rank should use; ``[]`` when ``write_this_rank`` is False.

    Paths always carry the rank, whether one rank writes or all do, so the layout never depends on that
    choice and runs from different ranks never clobber each other: JSONL at
    ``<dump>/metrics/rank_<r>.jsonl``, TensorBoard in ``<dump>/<tb_folder>/rank_<r>`` (point TensorBoard at
    ``<dump>/<tb_folder>`` and each rank is one run), W&B under ``<dump>/wandb``. The W&B project is
    ``WANDB_PROJECT`` or ``"torchtitan"``; its run is named ``run_name`` (``-rank<r>`` appended on ranks
    other than 0), and ``config_dict`` (the resolved job config) is stored with it.
    """
    if not write_this_rank:
        return []
    dump = Path(dump_folder)
    writers: list[MetricWriter] = []
    if enable_jsonl:
        writers.append(JsonlWriter(dump / "metrics" / f"rank_{rank}.jsonl"))
    if enable_tensorboard:
        writers.append(TensorBoardWriter(dump / tb_folder / f"rank_{rank}"))
    if enable_wandb:
        name = run_name if rank == 0 or run_name is None else f"{run_name}-rank{rank}"
        project = os.environ.get("WANDB_PROJECT") or "torchtitan"
        writers.append(WandbWriter(project, dump, config=config_dict, name=name))
    if writers:
        logger.info(
            "Metrics writers on rank %d: %s (under %s)",
            rank,
            ", ".join(type(w).__name__ for w in writers),
            dump,
        )
    return writers


def build_job_writers(cfg: Any, rank: int, write_this_rank: bool) -> list[MetricWriter]:
    """:func:`build_writers` as a job config's ``[metrics]`` and ``[job]`` sections say (the
    trainer's and ``python -m torchtitan.eval``'s); ``cfg`` is a ``JobConfig``."""
    m = cfg.metrics
    return build_writers(
        cfg.job.dump_folder,
        enable_jsonl=m.enable_jsonl,
        enable_tensorboard=m.enable_tensorboard,
        enable_wandb=m.enable_wandb,
        tb_folder=m.save_tb_folder,
        rank=rank,
        write_this_rank=write_this_rank,
        config_dict=dataclasses.asdict(cfg),
        run_name=cfg.job.description,
    )
