"""Distributed checkpoints (DCP): save, verify, resume, preemption, asynchronous saves.

One checkpoint per saved step, ``<dump_folder>/<checkpoint.folder>/step-N/``, holds:

- ``model``: the parameters and buffers of every model part, under the unparallelized model's
  names (``get_model_state_dict``: FSDP/TP DTensors are saved by shard and resharded at load);
- ``optimizer``: the optimizer state under the same names (``get_optimizer_state_dict``);
- ``lr_scheduler``, ``train_state`` (step, tokens seen, the settings a resume ignores): JSON in a
  ``uint8`` tensor, identical on every rank;
- ``dataloader``: each data-parallel rank's position (``dp_rank_<r>``, JSON in a tensor) and
  ``dp_world_size``;
- ``rng``: every rank's RNG states (``rank_<r>``, JSON in a tensor): torch CPU (and CUDA),
  Python ``random``; ``posttrain`` (``extra_state``, docs/posttrain.md): the reference, generators.

Nothing of ours is pickled, and loading goes through :mod:`checkpoint_trust` (a restricted
unpickler for DCP's ``.metadata``, ``weights_only`` for everything else): loading a checkpoint
executes no code from it (docs/checkpoint.md, "Trust model").

Two model-only kinds hold just ``model`` (the manifest says which): the ``seed`` checkpoint of
step 0 (:meth:`CheckpointManager.save_seed`, one process) and the ``export`` of the last step
(``last_save_model_only``, weights cast to ``export_dtype``), which resume skips.

Writing and checking the folder is :mod:`torchtitan.checkpoint.storage` (temporary name,
manifest with sizes and SHA-256, one rename when all ranks are done). All coordination runs on
a gloo group of its own; an asynchronous save gets a second one, used only by its thread,
because collectives issued concurrently from two threads on one group can pair up in different
orders on different ranks (docs/architecture.md, section 9).
"""

from __future__ import annotations

import pickle
import signal
import time
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from torchtitan.checkpoint import hf_io, safety
from torchtitan.checkpoint import storage as io
from torchtitan.checkpoint.state import (
    dataloader_target,
    load_model_state_dict,
    load_optimizer_state_dict,
    model_state_dict,
    optimizer_state_dict,
    rng_state,
    saved_blank,
    set_rng_state,
)
from torchtitan.checkpoint.trust import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    decode_state,
    encode_state,
)
from torchtitan.checkpoint.write_errors import make_step_folder, remove_partial_on_write_error
from torchtitan.config.sections import CHECKPOINT_PARTS
from torchtitan.guards.spikes import TrainingAborted, weights_finite
from torchtitan.tools.fault_injection import Faults
from torchtitan.tools.logging import logger
from torchtitan.tools.torch_compat import DEFAULT_STAGER_SINGLE_USE

AsyncMode = Literal["disabled", "async", "async_with_pinned_mem"]
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class _StagerLifecycle:
    """The ``DefaultStager`` background saves go through: reused from save to save where torch
    allows it (its host copies are then allocated once), a fresh one per save where a stager
    empties its own copy tables after one staging (``torch_compat.DEFAULT_STAGER_SINGLE_USE``:
    reusing one there fails at the second save with ``KeyError: <class 'type'>``)."""

    def __init__(self, pinned: bool) -> None:
        # (use_pinned_memory, use_shared_memory, use_async_staging, use_non_blocking_copy)
        self.options = StagingOptions(pinned, False, False, pinned)
        self._stager: DefaultStager | None = None
        self.created = 0

    def for_save(self) -> DefaultStager:
        if self._stager is None or DEFAULT_STAGER_SINGLE_USE:
            self.close()
            self._stager = DefaultStager(self.options)
            self.created += 1
        return self._stager

    def close(self) -> None:
        if self._stager is not None:
            self._stager.close()  # idempotent: torch may have closed it already
            self._stager = None


class CheckpointManager:
    """Saves at ``interval`` (and the last step), resumes from the newest valid checkpoint,
    and turns SIGTERM/SIGUSR1 into a save at the next step boundary.

    Call :meth:`load` once before training, :meth:`step_end` after every optimizer step (it
    returns True when the run must stop because of a preemption signal) and :meth:`close`
    at the end. Every rank must make the same calls: they are collective.
    """

    def __init__(
        self,
        *,
        root: Path,
        interval: int,
        keep_latest_k: int,
        async_mode: AsyncMode,
        load_step: int,
        total_steps: int,
        model_parts: list[nn.Module],
        optimizer: torch.optim.Optimizer,
        lr_scheduler: torch.optim.lr_scheduler.LRScheduler,
        dataloader: Any,
        verify_checksums: bool = True,
        exclude_from_loading: tuple[str, ...] = (),
        initial_load_path: str = "",
        initial_load_model_only: bool = True,
        initial_load_in_hf: bool = False,
        hf_adapter: Any = None,
        last_save_model_only: bool = False,
        export_dtype: torch.dtype = torch.float32,
        resume_settings: dict[str, dict[str, Any]] | None = None,
        extra_state: dict[str, Any] | None = None,
    ) -> None:
        self.root = root
        # A training mode's parts: name -> state_dict() (tensors, loaded in place), load_state_dict()
        self.extra_state = extra_state or {}
        # {component: {"section.field": value}}: settings the loaded component overrides
        # (stored in train_state; a resume whose config differs warns, naming them).
        self.resume_settings = resume_settings or {}
        self.last_save_model_only, self.export_dtype = last_save_model_only, export_dtype
        self.interval, self.keep_latest_k, self.total_steps = interval, keep_latest_k, total_steps
        self.async_mode, self.load_step = async_mode, load_step
        self.model_parts, self.optimizer = model_parts, optimizer
        self.lr_scheduler, self.dataloader = lr_scheduler, dataloader
        self.verify_checksums = verify_checksums
        self.exclude_from_loading = exclude_from_loading
        self.initial_load_path, self.initial_load_model_only = (
            initial_load_path,
            initial_load_model_only,
        )
        self.initial_load_in_hf, self.hf_adapter = initial_load_in_hf, hf_adapter
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        # Coordination group (main thread only) and the background save's group.
        self.pg = dist.new_group(backend="gloo")
        self.faults = Faults(self.rank)  # test-only; the trainer passes TORCHTITAN_FAULT's
        self.async_pg = dist.new_group(backend="gloo") if async_mode != "disabled" else None
        # (step, future of this rank's file digests): the background thread writes, then
        # hashes what this rank wrote, so the commit at a step boundary only gathers digests.
        self._pending: tuple[int, Future] | None = None
        self._digester = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-digest")
            if async_mode != "disabled"
            else None
        )
        # Background saves stage through one stager (host buffers allocated at the first save
        # and reused; pinned with async_with_pinned_mem, CUDA only, validated).
        self._stager = (
            _StagerLifecycle(pinned=async_mode == "async_with_pinned_mem")
            if async_mode != "disabled"
            else None
        )
        self._signal: int | None = None
        self.model_loaded = False  # by load(): the trainer initialises the weights otherwise
        self.last_save_blocking_s = 0.0
        self._old_handlers = {
            sig: signal.signal(sig, self._on_signal) for sig in PREEMPTION_SIGNALS
        }

    # ------------------------------------------------------------ signals
    def _on_signal(self, signum: int, frame: object) -> None:
        self._signal = signum  # acted on at the next step boundary, by every rank together

    # ------------------------------------------------------------ state
    def _state_dict(self, step: int, tokens_seen: int) -> dict[str, Any]:
        return {
            "model": model_state_dict(self.model_parts),
            "optimizer": optimizer_state_dict(self.model_parts, self.optimizer),
            "lr_scheduler": encode_state(self.lr_scheduler.state_dict()),
            "train_state": encode_state(
                {"step": step, "tokens_seen": tokens_seen, "settings": self.resume_settings}
            ),
            "dataloader": self._dataloader_state(),
            "rng": {f"rank_{self.rank}": rng_state()},
        } | {name: obj.state_dict() for name, obj in self.extra_state.items()}

    def _dataloader_state(self) -> dict[str, Any]:
        """The loader's state with its (in-memory, just made) pickled position re-encoded as
        JSON: what goes to disk is never a pickle."""
        out: dict[str, Any] = {}
        for k, v in self.dataloader.state_dict().items():
            if isinstance(v, (bytes, bytearray)):
                v = pickle.loads(v)  # our own bytes, from this process
            out[k] = encode_state(v) if k.startswith("dp_rank_") else torch.tensor(int(v))
        return out

    def _model_only(self, dtype: torch.dtype | None) -> dict[str, Any]:
        """``{"model": ...}`` with floating-point entries cast to ``dtype`` (None: as trained);
        DTensors stay sharded (``DTensor.to`` casts each shard)."""
        sd = model_state_dict(self.model_parts)
        if dtype is not None:
            sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}
        return {"model": sd}

    # ------------------------------------------------------------ load
    def load(self) -> dict[str, int] | None:
        """Restore the newest valid checkpoint (or ``load_step``); returns its train state
        ``{"step", "tokens_seen"}``, or None for a start from step 0 (no checkpoint: then the
        initial weights of ``initial_load_path`` are loaded when set)."""
        found: list[Any] = [None]
        if self.rank == 0:
            found[0] = self._find()
        dist.broadcast_object_list(found, src=0, group=self.pg)
        if isinstance(found[0], Exception):
            raise found[0]
        if found[0] is not None:
            if self.initial_load_in_hf and self._partial_model():
                self._load_hf(Path(self.initial_load_path))  # the base the adapters belong to
            return self._load_from(found[0].path, self._components())
        if not self.initial_load_path:
            logger.info(f"checkpoint: none found under {self.root}; starting from step 0")
            return None
        return self.load_initial()

    def load_initial(self) -> dict[str, int] | None:
        """``initial_load_path``'s weights (all, without initial_load_model_only)."""
        if self.initial_load_in_hf:
            self._load_hf(Path(self.initial_load_path))
            return None
        path = Path(self.initial_load_path)
        reason = [io.verify(path, self.verify_checksums) if self.rank == 0 else None]
        dist.broadcast_object_list(reason, src=0, group=self.pg)
        if reason[0] is not None:
            raise RuntimeError(f"checkpoint.initial_load_path {path} is invalid: {reason[0]}")
        wanted = (
            {"model"} if self.initial_load_model_only else CHECKPOINT_PARTS | set(self.extra_state)
        )
        return self._load_from(path, wanted - set(self.exclude_from_loading))

    def _components(self) -> set[str]:
        return (set(CHECKPOINT_PARTS) | set(self.extra_state)) - set(self.exclude_from_loading)

    def _partial_model(self) -> bool:
        """Whether checkpoints hold only part of the model (``checkpoint_keys``: adapters)."""
        return any(callable(getattr(p, "checkpoint_keys", None)) for p in self.model_parts)

    def rollback(self, before: int) -> dict[str, int] | None:
        """Load the newest valid resumable checkpoint of a step before ``before`` (after a loss
        spike); returns its train state, or None when there is none."""
        if self._pending is not None:
            self._finish_pending()
        found: list[Any] = [None]
        if self.rank == 0:
            for step in reversed([s for s in io.complete_steps(self.root) if s < before]):
                path = io.step_dir(self.root, step)
                if io.kind(path) != "export" and io.verify(path, self.verify_checksums) is None:
                    found[0] = path
                    break
        dist.broadcast_object_list(found, src=0, group=self.pg)
        if found[0] is None:
            return None
        return self._load_from(found[0], self._components())

    def _find(self) -> io.Found | Exception | None:
        """Rank 0's search (docs/checkpoint.md, "Safety"); an error is returned, to be raised
        on every rank."""
        try:
            if self.load_step >= 0:
                safety.refuse_older_load_step(self.root, self.load_step)
            found = io.find_checkpoint(self.root, self.load_step, self.verify_checksums)
            if found is None:
                safety.refuse_all_invalid(self.root, self.verify_checksums)
            return found
        except (OSError, RuntimeError) as e:
            return e

    def _load_lr_scheduler(self, saved: dict[str, Any]) -> None:
        """The schedule's position (``last_epoch``, ``_step_count``) from ``saved``; the rates per
        group from this optimizer's groups, restored by name just before: another layout may
        have other groups (a pipeline stage holds only some), so a saved per-group list would
        not line up."""
        own = self.lr_scheduler.state_dict()
        own.update({k: saved[k] for k in ("last_epoch", "_step_count") if k in saved})
        own["_last_lr"] = [g["lr"] for g in self.optimizer.param_groups]
        self.lr_scheduler.load_state_dict(own)

    def _load_from(
        self, path: Path, components: set[str] | frozenset[str]
    ) -> dict[str, int] | None:
        """Load ``components`` (those the checkpoint holds) from ``path``."""
        t0 = time.perf_counter()
        metadata = SafeFileSystemReader(str(path)).read_metadata().state_dict_metadata
        saved = set(metadata)
        blank = partial(saved_blank, metadata, path)

        components = {c for c in components if any(k.startswith(f"{c}.") or k == c for k in saved)}
        sd: dict[str, Any] = {}
        if "model" in components:
            sd["model"] = model_state_dict(self.model_parts)
        if "optimizer" in components:
            legacy = any(k.startswith("optimizer.param_groups.0.") for k in saved)
            sd["optimizer"] = optimizer_state_dict(self.model_parts, self.optimizer, legacy)
        for name in ("lr_scheduler", "train_state"):
            if name in components:
                sd[name] = blank(name)
        if "dataloader" in components:
            sd["dataloader"] = dataloader_target(saved, self.dataloader.state_dict(), blank)
        for name in components & set(self.extra_state):
            sd[name] = self.extra_state[name].state_dict()
        if "rng" in components:
            rng_key = f"rank_{self.rank}" if f"rng.rank_{self.rank}" in saved else "rank_0"
            sd["rng"] = {rng_key: blank(f"rng.{rng_key}")}
        dcp.load(
            sd,
            storage_reader=SafeFileSystemReader(str(path)),
            planner=SafeLoadPlanner(),
            process_group=self.pg,
        )
        if "model" in sd:
            load_model_state_dict(self.model_parts, sd["model"])
            self.model_loaded = True
        if "optimizer" in sd:
            load_optimizer_state_dict(self.model_parts, self.optimizer, sd["optimizer"])
        if "lr_scheduler" in sd:
            self._load_lr_scheduler(decode_state(sd["lr_scheduler"]))
        if "dataloader" in sd:
            self.dataloader.load_state_dict(
                {
                    k: decode_state(v) if k.startswith("dp_rank_") else int(v)
                    for k, v in sd["dataloader"].items()
                }
            )
        if "rng" in sd:
            set_rng_state(next(iter(sd["rng"].values())))
        for name in set(sd) & set(self.extra_state):
            self.extra_state[name].load_state_dict(sd[name])
        train_state = decode_state(sd["train_state"]) if "train_state" in sd else None
        if train_state is not None:
            safety.report_ignored_settings(
                path, train_state.pop("settings", {}), self.resume_settings, set(sd)
            )
        logger.info(
            f"checkpoint: loaded {sorted(sd)} from {path} in {time.perf_counter() - t0:.2f} s"
            + (f"; resuming after step {train_state['step']}" if train_state else "")
        )
        return train_state

    def _load_hf(self, folder: Path) -> None:
        """Initial weights from a Hugging Face folder (``*.safetensors``): every rank reads
        only the bytes of the shards it holds (docs/hf_io.md)."""
        if self.hf_adapter is None:
            raise RuntimeError("checkpoint.initial_load_in_hf: this model has no HF adapter")
        progress = hf_io.load_hf_streaming(self.model_parts, self.hf_adapter, folder)
        self.model_loaded = True
        hf_io.log_rate("initial weights from Hugging Face", progress, folder)

    # ------------------------------------------------------------ save
    def step_end(self, step: int, tokens_seen: int) -> bool:
        """At a step boundary: commit a finished background save, save if due or preempted.
        Returns True when a preemption signal was received (the checkpoint is then saved)."""
        preempted, pending_busy = self._agree()
        if self._pending is not None and not pending_busy:
            self._finish_pending()
        if preempted or step % self.interval == 0 or step == self.total_steps:
            self._refuse_nonfinite_weights(step)
        if step == self.total_steps and self.last_save_model_only:
            self.save(step, tokens_seen, blocking=True, kind="export")
            return preempted
        if preempted:
            logger.warning(f"checkpoint: preemption signal; saving step {step} and stopping")
            self.save(step, tokens_seen, blocking=True)
            return True
        if step % self.interval == 0 or step == self.total_steps:
            self.save(step, tokens_seen, blocking=step == self.total_steps)
        return False

    def _refuse_nonfinite_weights(self, step: int) -> None:
        """A checkpoint of NaN/inf weights would be resumed from and spread: abort instead
        (one pass over the parameters and one all-reduce, at save steps only)."""
        if not weights_finite(self.model_parts):
            raise TrainingAborted(
                f"step {step}: the model's weights are non-finite; not saving them as a "
                f"checkpoint (the newest good one in {self.root} stays the resume point). "
                "Lower the learning rate and resume"
            )

    def _agree(self) -> tuple[bool, bool]:
        """(any rank got a preemption signal, any rank's background save still running): the
        same answer on every rank, so all of them act at the same step."""
        busy = self._pending is not None and not self._pending[1].done()
        flags = torch.tensor([int(self._signal is not None), int(busy)], dtype=torch.int32)
        if self.world_size > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.pg)
        return bool(flags[0]), bool(flags[1])

    def save_seed(self) -> Path:
        """Save the model's current (initial) weights as the model-only ``seed`` checkpoint of
        step 0 (checkpoint.create_seed_checkpoint; one process, validated)."""
        self.save(0, 0, blocking=True, kind="seed")
        return io.step_dir(self.root, 0)

    def save(self, step: int, tokens_seen: int, blocking: bool = False, kind: str = "full") -> None:
        """Save step ``step``: everything (``full``), or only the model (``seed``: as is;
        ``export``: cast to ``export_dtype``). Model-only saves are always synchronous."""
        if self._pending is not None:
            self._finish_pending()
        t0 = time.perf_counter()
        tmp = make_step_folder(self.root, step, self.rank, self.pg, self.faults)
        writer = self.faults.checkpoint_writer(step, tmp)  # None (DCP's own) outside tests
        if kind == "full":
            sd = self._state_dict(step, tokens_seen)
        else:
            sd = self._model_only(self.export_dtype if kind == "export" else None)
        if self.async_mode == "disabled" or blocking or kind != "full":
            with remove_partial_on_write_error(self.root, step, self.rank, self.pg):
                dcp.save(sd, checkpoint_id=str(tmp), storage_writer=writer, process_group=self.pg)
                self._commit(step, kind)
            self.last_save_blocking_s = time.perf_counter() - t0
            what = {
                "full": "",
                "seed": " (seed: model only)",
                "export": f" (export: model only, {self.export_dtype})",
            }[kind]
            logger.info(f"checkpoint: saved step {step}{what} in {self.last_save_blocking_s:.2f} s")
            return
        assert self._stager is not None
        result = dcp.async_save(
            sd,
            checkpoint_id=str(tmp),
            storage_writer=writer,
            process_group=self.async_pg,
            async_stager=self._stager.for_save(),
        )
        future = result.upload_completion if isinstance(result, AsyncSaveResponse) else result
        assert self._digester is not None
        self._pending = (step, self._digester.submit(self._write_then_digest, future, tmp))
        self.last_save_blocking_s = time.perf_counter() - t0
        logger.info(
            f"checkpoint: step {step} staged in {self.last_save_blocking_s:.2f} s; "
            "writing in the background"
        )

    def _write_then_digest(self, write: Future, tmp: Path) -> dict[str, Any]:
        write.result()
        return io.digest_files(tmp, prefix=f"__{self.rank}_")

    def _finish_pending(self) -> None:
        assert self._pending is not None
        step, future = self._pending
        self._pending = None
        t0 = time.perf_counter()
        with remove_partial_on_write_error(self.root, step, self.rank, self.pg):
            self._commit(step, "full", future.result())
        logger.info(
            f"checkpoint: background save of step {step} committed (waited "
            f"{time.perf_counter() - t0:.2f} s)"
        )

    def _commit(self, step: int, kind: str = "full", mine: dict[str, Any] | None = None) -> None:
        """Every rank digests the files it wrote (unless ``mine`` has them already); rank 0
        writes the manifest, renames the folder and deletes what keep_latest_k no longer
        keeps."""
        tmp = io.tmp_dir(self.root, step)
        if mine is None:
            mine = io.digest_files(tmp, prefix=f"__{self.rank}_")
        gathered: list[Any] = [None] * self.world_size if self.rank == 0 else []
        dist.gather_object(mine, gathered if self.rank == 0 else None, dst=0, group=self.pg)
        failed: list[Any] = [None]  # rank 0's OSError (e.g. a full disk), shared with all
        if self.rank == 0:
            files: dict[str, Any] = {}
            for part in gathered:
                files.update(part)
            try:
                io.commit(self.root, step, files, self.world_size, kind=kind)
            except OSError as e:
                failed[0] = e
            else:
                for p in io.purge(self.root, self.keep_latest_k, newest=step):
                    logger.info(f"checkpoint: removed {p}")
        dist.broadcast_object_list(failed, src=0, group=self.pg)
        if failed[0] is not None:
            raise failed[0]

    def close(self) -> None:
        """Wait for a background save and commit it; restore the default signal handlers."""
        try:
            if self._pending is not None:
                self._finish_pending()
        finally:
            if self._stager is not None:
                self._stager.close()
            if self._digester is not None:
                self._digester.shutdown()
            for sig, handler in self._old_handlers.items():
                signal.signal(sig, handler)
