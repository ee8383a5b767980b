"""Tier 1: the checkpoint folder logic (manifest, commit, verification, fallback, purge) and the
checkpoint config checks; no process group."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from torchtitan.checkpoint import storage as io
from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig
from torchtitan.preflight.validate import validate_config


@pytest.fixture
def caplog_titan(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    # The project logger may not propagate to the root logger; capture it directly.
    from torchtitan.tools.logging import logger

    logger.addHandler(caplog.handler)
    caplog.set_level(logging.WARNING)
    yield caplog
    logger.removeHandler(caplog.handler)


def _save(root: Path, step: int, payload: bytes = b"x" * 1000, kind: str = "full") -> Path:
    """A fake committed checkpoint: what a DCP save leaves, then io.commit."""
    tmp = io.tmp_dir(root, step)
    tmp.mkdir(parents=True)
    (tmp / ".metadata").write_bytes(b"meta" + str(step).encode())
    (tmp / "__0_0.distcp").write_bytes(payload + str(step).encode())
    (tmp / "__1_0.distcp").write_bytes(payload[::-1])
    files = io.digest_files(tmp, prefix="__1_")  # as rank 1 would report; rank 0 digests the rest
    return io.commit(root, step, files, world_size=2, kind=kind)


def test_commit_renames_and_lists_every_file(tmp_path: Path) -> None:
    final = _save(tmp_path, 3)
    assert final == tmp_path / "step-3" and not io.tmp_dir(tmp_path, 3).exists()
    manifest = json.loads((final / io.MANIFEST).read_text())
    assert set(manifest["files"]) == {".metadata", "__0_0.distcp", "__1_0.distcp"}
    assert manifest["files"]["__0_0.distcp"]["size"] == 1001
    assert io.verify(final) is None


def test_truncated_missing_and_flipped_files_are_detected(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        _save(tmp_path, step)
    f = tmp_path / "step-1" / "__0_0.distcp"
    f.write_bytes(f.read_bytes()[:500])  # truncated
    assert "has 500 bytes" in (io.verify(tmp_path / "step-1") or "")
    (tmp_path / "step-2" / "__1_0.distcp").unlink()  # missing
    assert "__1_0.distcp is missing" in (io.verify(tmp_path / "step-2") or "")
    g = tmp_path / "step-3" / "__0_0.distcp"
    data = bytearray(g.read_bytes())
    data[10] ^= 0xFF  # same size, one byte flipped
    g.write_bytes(bytes(data))
    assert io.verify(tmp_path / "step-3", checksums=False) is None  # sizes alone cannot tell
    assert "SHA-256" in (io.verify(tmp_path / "step-3") or "")
    (tmp_path / "step-3" / io.MANIFEST).unlink()
    assert "no manifest" in (io.verify(tmp_path / "step-3") or "")


def test_newest_valid_is_found_and_skipped_ones_are_named(
    tmp_path: Path, caplog_titan: pytest.LogCaptureFixture
) -> None:
    for step in (2, 4, 6):
        _save(tmp_path, step)
    (tmp_path / "step-6" / "__1_0.distcp").write_bytes(b"short")  # corrupt newest
    io.tmp_dir(tmp_path, 8).mkdir()  # a save that never finished
    found = io.find_checkpoint(tmp_path)
    assert found is not None and found.step == 4
    text = caplog_titan.text
    assert "step-6" in text and "has 5 bytes" in text, text
    assert "step-8.tmp" in text and "never finished" in text, text


def test_load_step_is_exact(tmp_path: Path) -> None:
    _save(tmp_path, 2)
    _save(tmp_path, 4)
    assert io.find_checkpoint(tmp_path, load_step=2) == io.Found(2, tmp_path / "step-2")
    with pytest.raises(FileNotFoundError, match="step-3"):
        io.find_checkpoint(tmp_path, load_step=3)
    (tmp_path / "step-4" / "__0_0.distcp").unlink()
    with pytest.raises(RuntimeError, match="missing"):
        io.find_checkpoint(tmp_path, load_step=4)
    assert io.find_checkpoint(tmp_path / "nothing-here") is None


def test_purge_keeps_latest_k_and_only_after_commit(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        _save(tmp_path, step)
    io.tmp_dir(tmp_path, 2).mkdir()  # stale unfinished save, older than the newest commit
    io.tmp_dir(tmp_path, 9).mkdir()  # a newer one (e.g. in flight): left alone
    removed = io.purge(tmp_path, keep_latest_k=2, newest=3)
    assert sorted(p.name for p in removed) == ["step-1", "step-2.tmp"]
    assert io.complete_steps(tmp_path) == [2, 3] and io.tmp_dir(tmp_path, 9).exists()
    assert io.purge(tmp_path, keep_latest_k=0, newest=3) == []


def test_commit_replaces_an_existing_corrupt_folder(tmp_path: Path) -> None:
    _save(tmp_path, 5)
    (tmp_path / "step-5" / "__0_0.distcp").write_bytes(b"")
    assert io.verify(tmp_path / "step-5") is not None
    _save(tmp_path, 5, payload=b"y" * 10)
    assert io.verify(tmp_path / "step-5") is None


def test_resume_skips_a_model_only_export(tmp_path: Path) -> None:
    """last_save_model_only's final checkpoint has no optimizer/data/RNG: resume uses the
    newest full (or seed) checkpoint before it, and load_step naming the export is an error."""
    _save(tmp_path, 0, kind="seed")
    assert io.find_checkpoint(tmp_path) == io.Found(0, tmp_path / "step-0")
    _save(tmp_path, 3)
    _save(tmp_path, 6, kind="export")
    assert io.kind(tmp_path / "step-6") == "export" and io.kind(tmp_path / "step-0") == "seed"
    assert io.find_checkpoint(tmp_path) == io.Found(3, tmp_path / "step-3")
    assert io.find_checkpoint(tmp_path, skip_exports=False) == io.Found(6, tmp_path / "step-6")
    with pytest.raises(RuntimeError, match="model-only export"):
        io.find_checkpoint(tmp_path, load_step=6)
    # keep_latest_k counts resumable checkpoints only: the export never pushes step-3 out.
    assert [p.name for p in io.purge(tmp_path, keep_latest_k=1, newest=6)] == ["step-0"]
    assert io.complete_steps(tmp_path) == [3, 6]


def _seed_cfg(tmp_path: Path) -> JobConfig:
    cfg = JobConfig()
    cfg.job.dump_folder = str(tmp_path)
    cfg.checkpoint.enable = True
    cfg.checkpoint.create_seed_checkpoint = True
    return cfg


@pytest.mark.parametrize(
    "field, value, world, match",
    [
        ("parallelism.data_parallel_shard_degree", 2, 1, "parallelism.data_parallel_shard_degree"),
        ("parallelism.tensor_parallel_degree", 2, 1, "parallelism.tensor_parallel_degree"),
        ("parallelism.pipeline_parallel_degree", 2, 1, "parallelism.pipeline_parallel_degree"),
        ("parallelism.data_parallel_shard_degree", -1, 2, "runs on one process"),
        ("checkpoint.enable", False, 1, "add --checkpoint.enable"),
    ],
)
def test_seed_checkpoint_config_errors(
    tmp_path: Path, field: str, value: object, world: int, match: str
) -> None:
    cfg = _seed_cfg(tmp_path)
    section, name = field.split(".")
    setattr(getattr(cfg, section), name, value)
    with pytest.raises(ConfigError, match=match) as e:
        validate_config(cfg, world_size=world)
    assert "Fix:" in str(e.value)


def test_seed_checkpoint_refuses_a_folder_with_checkpoints(tmp_path: Path) -> None:
    validate_config(_seed_cfg(tmp_path), world_size=1)
    _save(tmp_path / "checkpoint", 4)
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        validate_config(_seed_cfg(tmp_path), world_size=1)


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("interval", 0, "checkpoint.interval"),
        ("keep_latest_k", -1, "checkpoint.keep_latest_k"),
        ("load_step", -2, "checkpoint.load_step"),
        ("folder", "", "checkpoint.folder"),
        ("async_mode", "async_with_pinned_mem", "needs CUDA"),
        ("export_dtype", "bfloat16", "add --checkpoint.last_save_model_only"),
    ],
)
def test_checkpoint_config_errors(field: str, value: object, match: str) -> None:
    cfg = JobConfig()
    cfg.checkpoint.enable = True
    setattr(cfg.checkpoint, field, value)
    if field == "async_mode":
        from torchtitan.distributed.utils import device_type

        if device_type() == "cuda":  # the suite pins CPU (tests/conftest.py) unless told
            pytest.skip("pinned-memory async saves are allowed with CUDA")
    with pytest.raises(ConfigError, match=match):
        validate_config(cfg, world_size=1)


def test_checkpoint_enable_is_accepted() -> None:
    cfg = JobConfig()
    cfg.checkpoint.enable = True
    cfg.checkpoint.async_mode = "async"
    validate_config(cfg, world_size=1)
