"""Fit before launch (``job.fit_check``, torchtitan/planner/fit.py): the estimate per rank against
this machine's GPU or host memory, before any process group."""

from __future__ import annotations

import pytest

from tests.fuzz_inputs import DEBUG_TOML, run_config_cli
from torchtitan.config.errors import ConfigError
from torchtitan.planner.estimator import GIB, estimate_memory
from torchtitan.planner.fit import check_fit
from torchtitan.preflight.validate import load_config


def _cfg(*argv: str, world: int = 1):  # noqa: ANN202 - a JobConfig
    return load_config(["--job.config_file", DEBUG_TOML, *argv], world_size=world)


def test_seq_len_1e8_does_not_fit_this_host() -> None:
    rc, out, err = run_config_cli(
        ["--launch", "--job.config_file", DEBUG_TOML, "--training.seq_len", "100000000"]
    )
    assert rc == 2 and out == ""
    assert err.startswith("config error: job.fit_check = 'error': the job does not fit: 1 rank(s)")
    assert "of host memory available" in err and "--job.fit_check warn" in err
    assert len(err.strip().splitlines()) == 1


def test_cpu_counts_every_rank_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cfg = _cfg(world=4)
    per_rank = estimate_memory(cfg, 4, device_type="cpu").total
    # 4 ranks x per rank just fits 4.2 x per rank (95%: a warning), not 3.9 x per rank.
    warnings = check_fit(cfg, 4, "cpu", host_available=int(4.2 * per_rank))
    assert len(warnings) == 1 and "4 rank(s) on this host" in warnings[0]
    with pytest.raises(ConfigError, match="does not fit: 4 rank"):
        check_fit(cfg, 4, "cpu", host_available=int(3.9 * per_rank))
    assert check_fit(cfg, 4, "cpu", host_available=8 * per_rank) == []
    # Under torchrun the ranks of this host are LOCAL_WORLD_SIZE, not the world.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert check_fit(cfg, 4, "cpu", host_available=int(3.9 * per_rank)) == []


def test_gpu_compares_one_rank_with_its_device() -> None:
    cfg = _cfg()
    per_rank = estimate_memory(cfg, 1, device_type="cuda").total
    with pytest.raises(ConfigError, match="of GPU memory available"):
        check_fit(cfg, 1, "cuda", device_free=per_rank - 1, host_available=100 * GIB)
    assert check_fit(cfg, 1, "cuda", device_free=2 * per_rank, host_available=100 * GIB) == []


def test_cpu_offload_host_side_is_checked_on_gpu() -> None:
    cfg = _cfg("--parallelism.fsdp_cpu_offload", world=1)
    est = estimate_memory(cfg, 1, device_type="cuda")
    assert est.host > 0
    with pytest.raises(ConfigError, match="FSDP CPU offload"):
        check_fit(cfg, 1, "cuda", device_free=100 * GIB, host_available=est.host // 2)


def test_warn_and_off_let_it_launch() -> None:
    warn = _cfg("--training.seq_len", "100000000", "--job.fit_check", "warn")
    (line,) = check_fit(warn, 1, "cpu", host_available=GIB)
    assert line.startswith("memory fit: 1 rank(s) on this host") and "out-of-memory" in line
    off = _cfg("--training.seq_len", "100000000", "--job.fit_check", "off")
    assert check_fit(off, 1, "cpu", host_available=GIB) == []


def test_gpu_free_memory_is_read_from_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The path that reads the real figure: ``torch.cuda.mem_get_info`` (patched at torch, not
    at fit.py) of this rank's GPU under torchrun (``LOCAL_RANK``), of the fullest GPU before
    launch (every rank of the host gets one)."""
    import torch

    cfg = _cfg()
    per_rank = estimate_memory(cfg, 1, device_type="cuda").total
    free = {0: 4 * per_rank, 1: per_rank // 2}
    asked: list[int] = []

    def mem_get_info(device: int) -> tuple[int, int]:
        asked.append(device)
        return free[device], 80 * GIB

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    small = f"{free[1] / GIB:.2f} GiB of GPU memory available"
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(ConfigError, match=small):
        check_fit(cfg, 1, "cuda", host_available=100 * GIB)
    assert sorted(asked) == [0, 1]
    asked.clear()
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert check_fit(cfg, 1, "cuda", host_available=100 * GIB) == []
    assert asked == [0]
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(ConfigError, match=small):
        check_fit(cfg, 1, "cuda", host_available=100 * GIB)
