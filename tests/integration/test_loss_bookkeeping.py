"""Loss bookkeeping between log steps is O(1) in device memory, whatever log_freq is
(docs/architecture.md, section 1, promise 3).

The trainer runs 200 steps; the bytes held by live tensors are measured (every tensor the garbage
collector can see, storages counted once) after step 10 and after step 200. A loop that kept
each step's loss tensor until the next log would hold 190 more tensors at log_freq 1000. The
control run injects exactly that leak and must be caught by the same measurement.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from tests.launcher import run_ranks
from tests.parity import DEBUG_TOML


def live_tensor_bytes() -> tuple[int, int]:
    """(number of live tensors, bytes of their distinct storages)."""
    seen: set[int] = set()
    count = total = 0
    for obj in gc.get_objects():
        # type(), not isinstance: isinstance reads __class__, which warns on torch's
        # deprecated torch.distributed.reduce_op object.
        if issubclass(type(obj), torch.Tensor) and not obj.is_meta:
            count += 1
            storage = obj.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return count, total


def _run(log_freq: int, leak: bool, dump: str) -> dict[int, tuple[int, int]]:
    from torchtitan.preflight.validate import load_config
    from torchtitan.training.trainer import Trainer

    cfg = load_config(
        [
            "--job.config_file",
            DEBUG_TOML,
            "--job.dump_folder",
            dump,
            "--training.steps",
            "200",
            "--training.seq_len",
            "16",
            "--training.local_batch_size",
            "2",
            "--metrics.log_freq",
            str(log_freq),
            "--metrics.no-enable_tensorboard",
            "--training.gc_freq",
            "0",
        ]
    )
    kept: list[torch.Tensor] = []
    samples: dict[int, tuple[int, int]] = {}

    class Probe(Trainer):
        def train_step(self):  # type: ignore[no-untyped-def]
            loss, grad_norm = super().train_step()
            if leak:
                kept.append(loss)  # the seed's bug: losses piling up until the next log
            if self.step in (10, 200):
                gc.collect()
                samples[self.step] = live_tensor_bytes()
            return loss, grad_norm

    trainer = Probe(cfg)
    try:
        trainer.train()
    finally:
        trainer.close()
    return samples


@pytest.mark.parametrize("log_freq", [1, 1000])
def test_loss_bookkeeping_does_not_grow(log_freq: int, tmp_path: Path) -> None:
    (samples,) = run_ranks(_run, 1, log_freq, False, str(tmp_path))
    (n10, b10), (n200, b200) = samples[10], samples[200]
    print(
        f"log_freq={log_freq}: step 10 {n10} tensors / {b10} B, step 200 {n200} tensors / {b200} B"
    )
    assert n200 == n10 and b200 == b10, f"live tensors grew from {samples[10]} to {samples[200]}"


def test_injected_loss_leak_is_detected(tmp_path: Path) -> None:
    (samples,) = run_ranks(_run, 1, 1000, True, str(tmp_path))
    (n10, _), (n200, _) = samples[10], samples[200]
    assert n200 - n10 == 190, f"the control leak should add 190 tensors, measured {n200 - n10}"
