"""Tier 1: checkpoint safety (no fresh start over invalid checkpoints, no older load_step over
newer ones, ignored settings named) and trust (no code runs from a checkpoint); no process
group."""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from torchtitan.checkpoint import safety
from torchtitan.checkpoint import storage as io
from torchtitan.checkpoint.trust import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    UntrustedCheckpointError,
    decode_state,
    encode_state,
)
from torchtitan.tools.torch_compat import single_process_dcp


class _Evil:
    """Unpickling this creates the file ``marker`` (what a crafted checkpoint would do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


def _weights(root: Path, step: int) -> Path:
    return io.write_model_weights(root, step, {"w": torch.arange(6.0).reshape(2, 3)})


def craft_metadata(folder: Path, marker: Path) -> None:
    """Replace ``folder``'s ``.metadata`` by a pickle running ``touch marker`` and rewrite the
    manifest to match (an attacker controls both)."""
    (folder / ".metadata").write_bytes(pickle.dumps(_Evil(marker)))
    manifest = json.loads((folder / io.MANIFEST).read_text())
    manifest["files"][".metadata"] = io.file_digest(folder / ".metadata")
    (folder / io.MANIFEST).write_text(json.dumps(manifest))


def test_state_codec_round_trips_rng_and_nested_state() -> None:
    state = {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "raw": b"\x00\xff",
        "nested": {1: [1.5, None, True], "s": ("a", 2)},
        "empty": torch.empty(0, dtype=torch.int64),
        "np": (np.int64(7), np.arange(6, dtype=np.uint32).reshape(2, 3)),
    }
    back = decode_state(encode_state(state))
    assert back["python"] == state["python"]  # tuples stay tuples: random.setstate accepts it
    random.setstate(back["python"])
    assert torch.equal(back["torch"], state["torch"]) and back["torch"].dtype == torch.uint8
    assert back["raw"] == b"\x00\xff" and back["nested"] == {1: [1.5, None, True], "s": ("a", 2)}
    assert back["empty"].shape == (0,) and back["empty"].dtype == torch.int64
    assert back["np"][0] == 7 and isinstance(back["np"][0], int)
    assert isinstance(back["np"][1], np.ndarray) and back["np"][1].dtype == np.uint32
    assert (back["np"][1] == state["np"][1]).all()
    assert encode_state(state).dtype == torch.uint8
    with pytest.raises(TypeError, match="cannot store a object"):
        encode_state({"x": object()})


def test_crafted_metadata_runs_nothing_and_is_refused(tmp_path: Path) -> None:
    folder = _weights(tmp_path / "ckpt", 1)
    assert torch.equal(io.read_model_weights(folder)["w"], torch.arange(6.0).reshape(2, 3))
    marker = tmp_path / "pwned"
    craft_metadata(folder, marker)
    assert io.verify(folder) is None  # the manifest was rewritten too: only trust can stop it
    with pytest.raises(UntrustedCheckpointError, match="posix.system|os.system"):
        io.read_model_weights(folder)
    with pytest.raises(UntrustedCheckpointError, match="not one of DCP's metadata types"):
        SafeFileSystemReader(str(folder)).read_metadata()
    assert not marker.exists(), "the crafted .metadata ran its code"
    # Control: the stock reader does run it (so the test above can fail); it then chokes on
    # os.system's return value.
    with pytest.raises(AttributeError):
        dcp.FileSystemReader(str(folder)).read_metadata()
    assert marker.exists()


def test_crafted_non_tensor_entry_is_refused(tmp_path: Path) -> None:
    """DCP saves non-tensor entries with torch.save and loads them with weights_only=False;
    the safe planner refuses bytes that need more than plain data."""
    marker = tmp_path / "pwned"
    folder = tmp_path / "ck"
    with single_process_dcp():
        dcp.save(
            {"x": _Evil(marker), "ok": {"lr": 0.1, "betas": (0.9, 0.95)}},
            checkpoint_id=str(folder),
            no_dist=True,
        )
    assert not marker.exists()
    sd: dict = {"ok": {"lr": 0.0, "betas": (0.0, 0.0)}}
    with single_process_dcp():
        dcp.load(
            sd,
            storage_reader=SafeFileSystemReader(str(folder)),
            planner=SafeLoadPlanner(),
            no_dist=True,
        )
    assert sd["ok"] == {"lr": 0.1, "betas": (0.9, 0.95)}
    # DCP wraps a rank's exception into its CheckpointException.
    with single_process_dcp(), pytest.raises(BaseException, match="entry x needs more"):
        dcp.load(
            {"x": None},
            storage_reader=SafeFileSystemReader(str(folder)),
            planner=SafeLoadPlanner(),
            no_dist=True,
        )
    assert not marker.exists(), "the crafted entry ran its code"


def test_older_load_step_with_newer_checkpoints_is_refused(tmp_path: Path) -> None:
    for step in (2, 4, 6):
        _weights(tmp_path, step)
    safety.refuse_older_load_step(tmp_path, 6)  # the newest: fine
    with pytest.raises(safety.CheckpointSafetyError, match=r"newer checkpoints \(step-4, step-6\)"):
        safety.refuse_older_load_step(tmp_path, 2)
    assert io.complete_steps(tmp_path) == [2, 4, 6]


def test_all_invalid_is_an_error_but_empty_or_one_valid_is_not(tmp_path: Path) -> None:
    safety.refuse_all_invalid(tmp_path / "none", checksums=True)
    for step in (3, 6):
        _weights(tmp_path, step)
    for step in (3, 6):
        f = next(io.step_dir(tmp_path, step).glob("*.distcp"))
        data = bytearray(f.read_bytes())
        data[-1] ^= 0xFF
        f.write_bytes(bytes(data))
    assert io.find_checkpoint(tmp_path) is None
    with pytest.raises(safety.CheckpointSafetyError, match="every checkpoint under .* is invalid"):
        safety.refuse_all_invalid(tmp_path, checksums=True)
    _weights(tmp_path, 9)
    safety.refuse_all_invalid(tmp_path, checksums=True)  # step-9 is valid


def test_ignored_settings_are_named(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    from torchtitan.config.job_config import JobConfig
    from torchtitan.tools.logging import logger

    cfg = JobConfig()
    saved = json.loads(json.dumps(safety.resume_settings(cfg)))  # as stored in train_state
    cfg.optimizer.lr, cfg.debug.seed = cfg.optimizer.lr * 10, 7
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.WARNING)
    try:
        now = safety.resume_settings(cfg)
        names = safety.report_ignored_settings(tmp_path, saved, now, {"optimizer", "rng"})
        assert names == ["optimizer.lr", "debug.seed"]
        assert "optimizer.lr" in caplog.text and "debug.seed" in caplog.text
        # Not loaded (exclude_from_loading): then the setting is not ignored.
        assert safety.report_ignored_settings(tmp_path, saved, now, {"model"}) == []
        assert safety.report_ignored_settings(tmp_path, saved, saved, {"optimizer", "rng"}) == []
    finally:
        logger.removeHandler(caplog.handler)
