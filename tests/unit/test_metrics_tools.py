"""Tier-1 tests for the observability tools: metric writers, memory monitor, peak FLOP/s and logging."""

from __future__ import annotations

import json
import logging
import math
import struct
import time
from pathlib import Path

import pytest
import torch

from torchtitan.metrics.writers import (
    JsonlWriter,
    MetricWriter,
    TensorBoardWriter,
    WandbWriter,
    build_writers,
)
from torchtitan.tools import peak_flops
from torchtitan.tools.device_memory import (
    DeviceMemoryMonitor,
    MemoryStats,
    device_memory_capacity_gib,
)
from torchtitan.tools.logging import init_logger, logger, warn_once
from torchtitan.tools.peak_flops import datasheet_peak_flops, measure_matmul_peak_flops

# ---------------------------------------------------------------- JSONL


def test_jsonl_writer_lines_and_nulls(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "dir" / "rank_0.jsonl"
    writer = JsonlWriter(path)
    writer.log({"loss": 2.5, "mfu": None, "tokens_per_s": 100}, step=1)
    # File is flushed after each line: readable before close.
    assert json.loads(path.read_text().splitlines()[0]) == {
        "step": 1,
        "loss": 2.5,
        "mfu": None,
        "tokens_per_s": 100,
    }
    writer.log({"loss": float("nan"), "grad_norm": torch.tensor(0.5)}, step=2)  # type: ignore[dict-item]
    writer.close()
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    assert '"mfu": null' in lines[0]
    second = json.loads(lines[1])
    assert second == {"step": 2, "loss": None, "grad_norm": 0.5}
    assert "NaN" not in lines[1]


# ---------------------------------------------------------------- TensorBoard


def test_tensorboard_writer_scalars_readable(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = TensorBoardWriter(tmp_path / "tb")
    writer.log({"loss": 3.0, "lr": 1e-3, "mfu": None}, step=1)
    writer.log({"loss": 2.0, "lr": 2e-3, "mfu": None}, step=2)
    writer.close()

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert set(tags) == {"loss", "lr"}  # None was skipped
    loss = [(e.step, e.value) for e in acc.Scalars("loss")]
    assert loss == [(1, 3.0), (2, 2.0)]
    lr = [(e.step, e.value) for e in acc.Scalars("lr")]
    assert [s for s, _ in lr] == [1, 2]
    assert lr[1][1] == pytest.approx(2e-3)


# ---------------------------------------------------------------- W&B (offline)


def _wandb_history(run_file: Path) -> list[dict[str, object]]:
    """Decode the history rows of an offline ``run-*.wandb`` file (a LevelDB-style record log of W&B
    protobuf ``Record``s: 7-byte file header, 32 KiB blocks, 7-byte chunk headers)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, block, chunks, records = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer too small for a header: padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        if kind == 0 and length == 0:
            break
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST chunk ends a record
            records.append(chunks)
            chunks = b""
    rows = []
    for raw in records:
        record = pb.Record()  # type: ignore[attr-defined]
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {
                    (item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                    for item in record.history.item
                }
            )
    return rows


def test_wandb_mode_defaults_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchtitan.metrics.writers import _wandb_mode

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert _wandb_mode() == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert _wandb_mode() == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert _wandb_mode() == "disabled"


def test_wandb_writer_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    writer = WandbWriter("torchtitan-test", tmp_path, config={"model": "debug"}, name="unit")
    assert writer.mode == "offline"
    writer.log({"loss": 4.0, "grad_norm": 1.5, "mfu": None}, step=1)
    writer.log({"loss": 3.5, "grad_norm": 1.25, "mfu": None}, step=2)
    writer.close()

    run_dirs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(run_dirs) == 1, list(tmp_path.rglob("*"))
    summary_file = run_dirs[0] / "files" / "wandb-summary.json"
    if summary_file.exists():  # older wandb versions write the summary for offline runs too
        summary = json.loads(summary_file.read_text())
        assert (summary["loss"], summary["grad_norm"]) == (3.5, 1.25)
        assert "mfu" not in summary
    run_files = list(run_dirs[0].glob("run-*.wandb"))
    assert len(run_files) == 1, "no offline run log written"
    # wandb's service process finishes writing the run file asynchronously after finish()
    # returns; on a loaded machine that can take a few seconds.
    deadline = time.monotonic() + 60
    rows = _wandb_history(run_files[0])
    while len(rows) < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
        rows = _wandb_history(run_files[0])
    assert [(r["_step"], r["loss"], r["grad_norm"]) for r in rows] == [(1, 4, 1.5), (2, 3.5, 1.25)]
    assert all("mfu" not in r for r in rows)


# ---------------------------------------------------------------- build_writers


def test_build_writers_layout(tmp_path: Path) -> None:
    def writers_of(rank: int, write_this_rank: bool) -> list:
        return build_writers(
            str(tmp_path), enable_jsonl=True, enable_tensorboard=True, enable_wandb=False,
            tb_folder="tb", rank=rank, write_this_rank=write_this_rank, config_dict=None,
            run_name=None,
        )  # fmt: skip

    assert writers_of(1, write_this_rank=False) == []
    writers = writers_of(3, write_this_rank=True)
    assert [type(w).__name__ for w in writers] == ["JsonlWriter", "TensorBoardWriter"]
    assert all(isinstance(w, MetricWriter) for w in writers)
    for w in writers:
        w.log({"loss": 1.0}, step=5)
        w.close()
    assert (tmp_path / "metrics" / "rank_3.jsonl").exists()
    assert list((tmp_path / "tb" / "rank_3").glob("events.out.tfevents.*"))


# ---------------------------------------------------------------- memory


def test_memory_monitor_cpu() -> None:
    monitor = DeviceMemoryMonitor(torch.device("cpu"))
    monitor.reset_peak()
    before = monitor.stats()
    assert isinstance(before, MemoryStats)
    assert before.device_type == "cpu"
    assert before.rss_gib > 0 and before.current_gib > 0
    assert before.peak_gib >= before.current_gib
    assert before.peak_rss_gib >= before.rss_gib
    assert before.reserved_gib is None and before.num_ooms is None

    big = torch.ones(50 * 1024 * 1024, dtype=torch.float32)  # 200 MiB, touched by the fill
    monitor.sample()
    del big
    after = monitor.stats()
    assert after.peak_gib >= before.peak_gib + 0.15, (before, after)
    assert after.peak_gib >= after.current_gib
    assert after.peak_rss_gib >= after.peak_gib - 1e-6

    flat = after.as_dict()
    assert "memory/peak_gib" in flat and "memory/rss_gib" in flat
    assert "memory/reserved_gib" not in flat and "memory/device_type" not in flat
    assert all(isinstance(v, (int, float)) and math.isfinite(v) for v in flat.values())
    assert set(monitor.as_dict(prefix="m.")) == {k.replace("memory/", "m.") for k in flat}


def test_device_memory_capacity_cpu() -> None:
    capacity = device_memory_capacity_gib("cpu")
    assert 0 < capacity < 1e6


# ---------------------------------------------------------------- peak FLOP/s


def test_datasheet_peak_none_on_cpu() -> None:
    assert datasheet_peak_flops(torch.device("cpu"), torch.bfloat16) is None
    assert datasheet_peak_flops("cpu", torch.float32) is None


def test_datasheet_table_matching() -> None:
    from torchtitan.tools.peak_flops import _lookup

    assert _lookup("NVIDIA H100 80GB HBM3")["bf16"] == 989.4  # type: ignore[index]
    assert _lookup("NVIDIA H100 PCIe")["bf16"] == 756.5  # type: ignore[index]
    assert _lookup("NVIDIA A100-SXM4-80GB")["bf16"] == 312.0  # type: ignore[index]
    assert _lookup("NVIDIA A10")["bf16"] == 125.0  # type: ignore[index]
    assert _lookup("NVIDIA A10G") is None  # not A10
    assert _lookup("NVIDIA L40") is None  # not L40S
    assert _lookup("NVIDIA H100") is None  # ambiguous variant: no guess
    assert _lookup("Some Future GPU") is None


def test_datasheet_peak_by_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    # Pretend to be on an H100 SXM so the CUDA path runs on a CPU-only machine.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(peak_flops, "_tf32_enabled", lambda: False)
    assert datasheet_peak_flops("cuda", torch.bfloat16) == pytest.approx(989.4e12)
    assert datasheet_peak_flops("cuda:0", torch.float8_e4m3fn) == pytest.approx(1978.9e12)
    assert datasheet_peak_flops("cuda", torch.float32) == pytest.approx(66.9e12)
    monkeypatch.setattr(peak_flops, "_tf32_enabled", lambda: True)
    assert datasheet_peak_flops("cuda", torch.float32) == pytest.approx(494.7e12)
    assert datasheet_peak_flops("cuda", torch.int8) is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA A10G")
    assert datasheet_peak_flops("cuda", torch.bfloat16) is None


def test_measured_matmul_peak_cpu() -> None:
    flops = measure_matmul_peak_flops(torch.device("cpu"), torch.float32)
    assert math.isfinite(flops) and flops > 0
    small = measure_matmul_peak_flops("cpu", torch.float32, size=256, iters=2)
    assert math.isfinite(small) and small > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_measured_matmul_peak_cuda() -> None:
    flops = measure_matmul_peak_flops("cuda", torch.bfloat16, size=4096, iters=5)
    assert math.isfinite(flops) and flops > 0
    peak = datasheet_peak_flops("cuda", torch.bfloat16)
    if peak is not None:
        assert flops < 1.1 * peak


# ---------------------------------------------------------------- logging


@pytest.fixture
def restore_logger():
    """Remove the handler the test installed: it writes to capsys's stream, which closes after the test."""
    before = list(logger.handlers), logger.level
    yield
    for handler in list(logger.handlers):
        if handler not in before[0]:
            logger.removeHandler(handler)
    logger.setLevel(before[1])


def test_init_logger_single_handler(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, restore_logger
) -> None:
    monkeypatch.delenv("LOGLEVEL", raising=False)
    init_logger("[rank 0] ")
    init_logger("[rank 3 pp=1 dp_shard=0 tp=1] ")
    ours = [h for h in logger.handlers if getattr(h, "_torchtitan_handler", False)]
    assert len(ours) == 1
    assert len(logger.handlers) == 1
    logger.info("hello 100%")
    out = capsys.readouterr().out
    assert out.count("hello 100%") == 1
    assert "[titan] " in out and " INFO [rank 3 pp=1 dp_shard=0 tp=1] hello" in out
    assert "[rank 0]" not in out


def test_loglevel_env_and_warn_once(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], restore_logger
) -> None:
    monkeypatch.setenv("LOGLEVEL", "warning")
    init_logger()
    assert logger.level == logging.WARNING
    logger.info("invisible")
    warn_once("careful")
    warn_once("careful")
    out = capsys.readouterr().out
    assert "invisible" not in out
    assert out.count("careful") == 1
    monkeypatch.delenv("LOGLEVEL")
    init_logger()
    assert logger.level == logging.INFO
