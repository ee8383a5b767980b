"""The trainer's side of torchft: one ``ReplicaGroup`` per rank, called at three points of a
step (docs/fault_tolerance.md, "Seams"):

- ``start_step(step)`` before the step: joins the quorum of live replica groups; a group behind
  the others (restarted, or new) receives a healthy peer's state here and the step to run next;
- ``reduce_and_commit(params)`` after the backward: averages the gradients across the groups
  (rank ``r`` of each group with rank ``r`` of the others, so any FSDP/TP layout inside a group
  works) and asks the Manager whether the step may be applied; ``False`` discards it;
- ``after_update(step)`` after the optimizer step: under ``semi_sync`` (semi_sync.py) the two
  calls above do nothing, and every ``sync_every`` steps this one syncs the groups;
- ``close()`` at the end.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from torchtitan.config.sections import FaultTolerance
from torchtitan.fault_tolerance.outer_state import PART, OuterState
from torchtitan.fault_tolerance.semi_sync import SemiSync
from torchtitan.guards.spikes import TrainingAborted
from torchtitan.tools.logging import logger


class ReplicasLost(TrainingAborted):
    """Fewer replica groups than fault_tolerance.min_replicas answer: the job stops."""


def data_shard(ft: FaultTolerance, dp_rank: int, dp_world: int) -> tuple[int, int]:
    """This rank's (data rank, data world) when every replica group reads its own share of the
    data: group ``g``'s data-parallel rank ``r`` reads shard ``g * dp_world + r``."""
    if not ft.enable:
        return dp_rank, dp_world
    return ft.replica_id * dp_world + dp_rank, ft.group_size * dp_world


def data_position(loader: Any) -> bytes:
    """A ``ParallelAwareDataloader``'s position in its own shard (its pickled loader state)."""
    return loader.state_dict()[f"dp_rank_{loader.dp_rank}"]


def load_data_position(loader: Any, position: bytes) -> None:
    """Continue ``loader`` from a peer's position: under window sharding (the preflight's rule)
    every shard is at the same window count when the groups step in lockstep, so the peer's
    position in its shard is this rank's in its own."""
    loader.load_state_dict(
        {f"dp_rank_{loader.dp_rank}": position, "dp_world_size": loader.dp_world_size}
    )


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP/TP), else the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


class ReplicaGroup:
    """This rank's torchft Manager and the state a recovering peer receives from it."""

    def __init__(
        self,
        ft: FaultTolerance,
        model_parts: list[nn.Module],
        optimizer: torch.optim.Optimizer,
        lr_scheduler: Any,
        dataloader: Any,
        on_data_reset: Any,
        step: int,
        device: torch.device,
        outer_state: OuterState | None = None,
    ) -> None:
        """``outer_state``: DiLoCo's checkpoint part (outer_state.py), when checkpointing."""
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

        # torch's loader of a received state warns that torchft's read-only buffer is copied
        warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)

        self.ft, self.model_parts, self.optimizer = ft, model_parts, optimizer
        self.lr_scheduler, self.dataloader, self.on_data_reset = (
            lr_scheduler,
            dataloader,
            on_data_reset,
        )
        timeout = timedelta(seconds=ft.timeout_seconds)
        pg = ProcessGroupNCCL(timeout) if device.type == "cuda" else ProcessGroupGloo(timeout)
        self.recoveries: list[tuple[int, float]] = []  # (step received, seconds taken)
        self.committed = True  # whether the last step's update was applied
        self.save_on_stop: Callable[[int], None] | None = None  # a checkpoint before stopping
        self._recovered = False  # whether this step's quorum loaded a peer's state
        self.manager = Manager(
            pg=pg,
            load_state_dict=self._load_state_dict,
            state_dict=self._state_dict,
            min_replica_size=ft.min_replicas,
            use_async_quorum=False,  # a recovering group loads its state before the forward
            timeout=timeout,
            quorum_timeout=timedelta(seconds=ft.quorum_timeout_seconds),
            connect_timeout=timedelta(seconds=ft.connect_timeout_seconds),
            rank=int(os.environ.get("RANK", "0")),
            world_size=int(os.environ.get("WORLD_SIZE", "1")),
            lighthouse_addr=ft.lighthouse or None,
            replica_id=f"replica_{ft.replica_id}",
            init_sync=False,  # every group initialises the same weights from debug.seed
            max_retries=3,
            quorum_retries=ft.quorum_retries,
        )
        # the Manager counts commits: one per step, or one per sync under semi_sync
        self.sync_every = ft.sync_every if ft.semi_sync != "none" else 1
        self.manager.load_state_dict({"step": step // self.sync_every, "batches_committed": 0})
        self.bytes_sent, self._logged = 0, (0, step)  # cross-group all-reduce bytes, last log
        self._count_bytes()
        self._step, self._peer_step = step, None  # this group's step; a peer's, on recovery
        self.semi = None
        if ft.semi_sync != "none":
            self.semi = SemiSync(ft, self.manager, model_parts, optimizer, step, outer_state)
        sync = "every step" if self.semi is None else f"{ft.semi_sync} every {ft.sync_every}"
        logger.info(
            f"fault tolerance: replica group {ft.replica_id} of {ft.group_size}, lighthouse "
            f"{ft.lighthouse or os.environ.get('TORCHFT_LIGHTHOUSE', '')}, min replicas "
            f"{ft.min_replicas}, groups sync {sync}"
        )

    def _count_bytes(self) -> None:
        """Count the bytes of every cross-group all-reduce (this rank's tensors), torchft's
        LocalSGD/DiLoCo ones included: they call the Manager's ``allreduce``."""
        allreduce = self.manager.allreduce

        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if self.manager.errored() is None:
                self.bytes_sent += tensor.numel() * tensor.element_size()
            return allreduce(tensor, *args, **kwargs)

        self.manager.allreduce = counted  # type: ignore[method-assign]

    def fields(self) -> tuple[dict[str, float | int | None], str]:
        """A metrics source (``MetricsProcessor.extra_fields``): the bytes this rank
        all-reduced across the groups, in total and per step since the last log step."""
        total, step = self.bytes_sent, self._step
        per_step = (total - self._logged[0]) / max(step - self._logged[1], 1)
        self._logged = (total, step)
        return {"ft/bytes_total": total, "ft/bytes_per_step": per_step}, ""

    @classmethod
    def for_trainer(cls, trainer: Any) -> ReplicaGroup:
        """Built from the Trainer's collaborators, after its checkpoint load (its step)."""
        steps = trainer.stepper

        def data_reset() -> None:  # the next batch comes from the loaded data position
            steps.data_iter = None
            steps.microbatches_drawn = trainer.replicas.resumed_step() * steps.grad_accum_steps

        ckpt = trainer.checkpointer
        group = cls(
            trainer.cfg.fault_tolerance,
            trainer.model_parts,
            trainer.optimizer,
            trainer.lr_scheduler,
            trainer.dataloader,
            data_reset,
            trainer.step,
            trainer.device,
            ckpt.extra_state.get(PART) if ckpt is not None else None,
        )
        if ckpt is not None:

            def save(step: int) -> None:  # the last committed step, unless saved already
                if step > 0 and step % ckpt.interval != 0:
                    ckpt.save(step, step * trainer.global_tokens_per_step, blocking=True)

            group.save_on_stop = save
        trainer.metrics.extra_fields.append(group.fields)
        return group

    # ------------------------------------------------------------------ the step's seams
    def start_step(self, step: int) -> int:
        """Join this step's quorum; returns the number of the last committed step (a
        recovering group's comes from its peer)."""
        if self.semi is not None:  # no quorum: the groups meet at the sync (after_update)
            if self._peer_step is not None:
                step, self._peer_step = self._peer_step, None
            self._step = step
            return step
        start, self._recovered = time.perf_counter(), False
        before = self.manager.current_step()
        try:
            self.manager.start_quorum()
        except Exception as e:  # the lighthouse gave no quorum in time
            text = " ".join(str(e).split())[:300]
            why = f"no quorum within {self.ft.quorum_timeout_seconds:g} s: {text}"
            if self.save_on_stop is not None:  # the weights are those of the last commit
                committed = self.manager.current_step()
                self.save_on_stop(committed)
                why += f"; step {committed}, the last committed, is in the checkpoint folder"
            raise self._lost(why) from None
        if self.manager.errored() is not None:
            logger.warning(f"fault tolerance: quorum error ({e_text(self)}); the step is redone")
        committed = self.manager.current_step()
        if self._recovered:
            seconds = time.perf_counter() - start
            self.recoveries.append((committed, seconds))
            logger.info(
                f"fault tolerance: recovered live from a peer at step {committed} "
                f"(was at step {before}) in {seconds:.2f} s"
            )
        return committed

    def reduce_and_commit(self, params: Iterable[nn.Parameter]) -> bool:
        """Average the gradients over the live replica groups; whether the step commits.
        Under semi_sync the step is local and always kept."""
        if self.semi is not None:
            self.committed = True
            return True
        grads = [_local(p.grad) for p in params if p.grad is not None]
        for dtype in {g.dtype for g in grads}:
            same = [g for g in grads if g.dtype == dtype]
            flat = torch.cat([g.reshape(-1) for g in same])
            self.manager.allreduce(flat).wait()
            offset = 0
            for g in same:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        try:
            ok = self.committed = self.manager.should_commit()
        except RuntimeError as e:  # max_retries commits failed in a row
            raise self._lost(str(e)) from None
        if not ok:
            logger.warning(
                f"fault tolerance: step discarded ({self.manager.num_participants()} groups "
                f"took part, error: {e_text(self)}); it will be run again"
            )
        return ok

    def after_update(self, step: int) -> None:
        """After step ``step``'s optimizer step (taken or skipped): under semi_sync, count the
        inner step and sync the groups at every sync_every-th. A recovering group receives a
        peer's state at the sync's quorum and continues from the peer's step."""
        self._step = step
        if self.semi is None:
            return
        self._recovered = False
        start, before = time.perf_counter(), self.manager.current_step()
        try:
            synced = self.semi.after_inner_step()
        except Exception as e:  # the lighthouse gave no quorum in time, or commits failed
            raise self._lost(" ".join(str(e).split())[:300]) from None
        if self._recovered and self._peer_step is not None:
            seconds = time.perf_counter() - start
            self.recoveries.append((self._peer_step, seconds))
            logger.info(
                f"fault tolerance: recovered live from a peer at step {self._peer_step} "
                f"(was at step {step}) in {seconds:.2f} s"
            )
        elif synced and self.manager.current_step() == before:
            logger.warning(
                f"fault tolerance: the {self.ft.semi_sync} sync after step {step} did not "
                f"commit ({self.manager.num_participants()} groups took part, error: "
                f"{e_text(self)}); the groups go on from their weights of the last sync"
            )

    def resumed_step(self) -> int:
        """The step a recovering group continues from: its peer's."""
        if self.semi is not None and self._peer_step is not None:
            return self._peer_step
        return self.manager.current_step()

    def close(self) -> None:
        self.manager.shutdown(wait=False)

    # ------------------------------------------------------------------ live recovery
    def _state_dict(self) -> dict[str, Any]:
        """What a recovering peer's rank receives from this one: the model and optimizer
        (local shards), the LR schedule and this rank's data position."""
        return {
            "model": [part.state_dict() for part in self.model_parts],
            "optimizer": self.optimizer.state_dict(),
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "data": data_position(self.dataloader),
            "step": self._step,
        }

    def _load_state_dict(self, sd: dict[str, Any]) -> None:
        for part, part_sd in zip(self.model_parts, sd["model"], strict=True):
            part.load_state_dict(part_sd)
        self.optimizer.load_state_dict(sd["optimizer"])
        self.lr_scheduler.load_state_dict(sd["lr_scheduler"])
        load_data_position(self.dataloader, sd["data"])
        self._peer_step = sd["step"]
        self.on_data_reset()
        self._recovered = True

    def _lost(self, why: str) -> ReplicasLost:
        ft = self.ft
        return ReplicasLost(
            f"fault tolerance: fewer than fault_tolerance.min_replicas={ft.min_replicas} of "
            f"{ft.group_size} replica groups are alive at step {self.manager.current_step()} "
            f"({why}); stopping. Fix: restart the lost groups (same fault_tolerance.replica_id); "
            "they rejoin from a live peer, or all resume from the last checkpoint"
        )


def e_text(group: ReplicaGroup) -> str:
    err = group.manager.errored()
    return "none" if err is None else str(err.original_exception).split("\n")[0][:200]
