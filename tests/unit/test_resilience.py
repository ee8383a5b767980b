"""Tier 1: spike detector and policies, skip limits, straggler flag, hang watchdog, fault
injection parsing and the resilience config checks; no process group."""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig
from torchtitan.guards.spikes import SpikeDetector, StepGuard, TrainingAborted
from torchtitan.preflight.validate_resilience import validate_resilience
from torchtitan.tools.fault_injection import parse_faults
from torchtitan.tools.stragglers import StragglerFlag
from torchtitan.tools.watchdog import Watchdog


def _guard(policy: str, limit: int = 3) -> StepGuard:
    return StepGuard(
        policy,  # type: ignore[arg-type]
        window=8,
        threshold=6.0,
        warmup=4,
        max_consecutive_skips=limit,
        rank=0,
    )


def test_robust_z_score_flags_a_jump_not_noise_or_a_falling_loss() -> None:
    d = SpikeDetector(window=8, threshold=6.0, warmup=4)
    losses = [5.0, 4.9, 5.1, 4.95, 5.05, 4.9, 5.0, 5.1]
    for i, v in enumerate(losses[:3]):
        assert d.score(100.0) == 0.0  # warm-up: nothing is scored
        d.accept(i, v)
    for i, v in enumerate(losses[3:], start=3):
        d.accept(i, v)
    # median 5.0, MAD 0.075 -> sigma 0.111: 5.3 is z 2.7, 6.0 is z 9.0
    assert d.score(5.3) == pytest.approx(0.3 / (1.4826 * 0.075))
    assert d.score(5.3) < 6.0 < d.score(6.0)
    assert d.score(1.0) < 0  # a drop is never a spike
    d.forget_after(4)
    assert [s for s, _ in d.history] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    "policy, verdict", [("warn", "step"), ("skip_step", "skip"), ("rollback", "rollback")]
)
def test_policies_on_a_spike(policy: str, verdict: str) -> None:
    g = _guard(policy)
    for step in range(1, 7):
        assert g.check(step, 5.0 + 0.01 * (step % 3), "mb") == "step"
    assert g.check(7, 50.0, "microbatches 6..6") == verdict
    assert g.events == [
        {"step": 7, "rank": 0, "score": pytest.approx(g.events[0]["score"]), "policy": policy}
    ]
    assert float(g.events[0]["score"]) > 6.0
    # Only warn lets the spiking loss into the window.
    assert (g.detector.history[-1][1] == 50.0) == (policy == "warn")
    assert _guard("off").check(7, 1e9, "mb") == "step"


def test_consecutive_skips_abort_and_reset() -> None:
    model = [nn.Linear(2, 2)]
    g = _guard("skip_step", limit=3)
    g.skipped(1, "loss spike", model)
    g.skipped(2, "loss spike", model)
    g.stepped()  # a good step resets the run
    g.skipped(4, "loss spike", model)
    g.skipped(5, "non-finite values", model)
    with pytest.raises(
        TrainingAborted,
        match=r"3 consecutive steps skipped \(the last at step 6.*max_consecutive_skips = 3",
    ):
        g.skipped(6, "non-finite values", model)


def test_nonfinite_weights_abort_at_the_first_skip() -> None:
    model = [nn.Linear(2, 2)]
    with torch.no_grad():
        model[0].weight[0, 0] = math.nan
    with pytest.raises(TrainingAborted, match="weights themselves are non-finite"):
        _guard("skip_step", limit=0).skipped(3, "non-finite values", model)


def test_rollback_skips_the_bad_batches_once_and_is_bounded() -> None:
    g = _guard("rollback", limit=2)
    g.rolled_back(bad_step=5, to_step=3, microbatches=2)
    assert g.batches_to_skip(4) == 0 and g.batches_to_skip(5) == 2 and g.batches_to_skip(5) == 0
    with pytest.raises(TrainingAborted, match="step 5 spiked again after 2 rollbacks"):
        g.rolled_back(bad_step=5, to_step=3, microbatches=2)


def _view(step_times: tuple[float, float, int], data: tuple[float, float, int]) -> dict:
    return {
        "step_time_s_min": step_times[0],
        "step_time_s_max": step_times[1],
        "step_time_s_max_rank": step_times[2],
        "data_time_s_min": data[0],
        "data_time_s_max": data[1],
        "data_time_s_max_rank": data[2],
    }


def test_straggler_flagged_after_n_log_steps_of_the_same_rank() -> None:
    f = StragglerFlag(margin=0.5, log_steps=3)
    slow = _view((1.0, 1.1, 0), (0.01, 0.3, 1))
    assert f.update(1, slow) == "" and f.update(2, slow) == ""
    text = f.update(3, slow)
    assert "STRAGGLER rank 1: data time 0.300s vs fastest 0.010s for 3 log steps" in text
    assert f.flagged == [(3, "data_time_s", 1)]
    # Within the margin, or another rank: the streak restarts.
    f2 = StragglerFlag(margin=0.5, log_steps=2)
    assert f2.update(1, _view((1.0, 1.4, 0), (0.0, 0.001, 1))) == ""  # 40% < 50%; 1 ms gap
    f2.update(2, _view((1.0, 1.0, 0), (0.01, 0.3, 1)))
    f2.update(3, _view((1.0, 1.0, 0), (0.01, 0.3, 0)))
    assert f2.flagged == []


def test_watchdog_dumps_every_thread_and_the_phase(tmp_path: Path) -> None:
    wd = Watchdog(timeout_s=0.3, dump_dir=tmp_path, rank=3, poll_s=0.05)
    try:
        wd.beat(7, "training step")
        wd.phase("metrics log (cross-rank all-reduce)")
        blocker = threading.Event()
        worker = threading.Thread(target=blocker.wait, name="stuck-helper", daemon=True)
        worker.start()
        deadline = time.monotonic() + 10
        while not wd.dumps and time.monotonic() < deadline:
            time.sleep(0.05)
        blocker.set()
        (path,) = wd.dumps
        assert path == tmp_path / "rank_3_step_7.txt"
        text = path.read_text()
        assert "rank 3: step 7 has run for" in text
        assert "waiting in: metrics log (cross-rank all-reduce)" in text
        assert "test_watchdog_dumps_every_thread_and_the_phase" in text  # the main thread's stack
        assert "thread stuck-helper" in text
        time.sleep(0.5)
        assert len(wd.dumps) == 1, "one dump per step"
        wd.beat(8)  # a new step restarts the clock
        wd.pause()
        time.sleep(0.5)
        assert len(wd.dumps) == 1
    finally:
        wd.close()


def test_fault_spec_parsing() -> None:
    f = parse_faults(1, "kill:rank=1,step=4; slow:rank=0,seconds=0.5;spike:step=5,factor=10")
    assert f.specs["kill"] == {"rank": 1.0, "step": 4.0}
    assert f._mine("slow") is None and f._mine("kill") is not None
    assert f.loss_factor(4) == 1.0 and f.loss_factor(5) == 10.0 and f.loss_factor(5) == 1.0
    assert parse_faults(0, "").specs == {}
    with pytest.raises(ValueError, match="unknown fault 'explode'"):
        parse_faults(0, "explode:rank=0")
    with pytest.raises(ValueError, match="needs step=S"):
        parse_faults(0, "hang:rank=0")


def test_full_disk_faults(tmp_path: Path) -> None:
    """``full_disk``: rank R's DCP writer from step S on writes half, then ENOSPC;
    ``mkdir_error``: rank 0's creation of step-N.tmp fails from step S on."""
    import errno

    spec = "full_disk:rank=1,step=4;mkdir_error:step=6,errno=13"
    zero, one = parse_faults(0, spec), parse_faults(1, spec)
    assert (
        zero.checkpoint_writer(4, tmp_path) is None and one.checkpoint_writer(3, tmp_path) is None
    )
    writer = one.checkpoint_writer(5, tmp_path)
    with writer.fs.create_stream(tmp_path / "f", "wb") as stream, pytest.raises(OSError) as e:
        stream.write(b"0123456789")
    assert e.value.errno == errno.ENOSPC and (tmp_path / "f").read_bytes() == b"01234"
    zero.before_checkpoint_mkdir(5)
    one.before_checkpoint_mkdir(6)  # only rank 0 creates the folder
    with pytest.raises(PermissionError):
        zero.before_checkpoint_mkdir(7)
    with pytest.raises(ValueError, match="needs rank=R"):
        parse_faults(0, "full_disk:step=4")


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("training.spike_policy", "rollback", "needs checkpoint.enable"),
        ("training.spike_window", 2, "integer >= 3"),
        ("training.spike_threshold", math.nan, "finite number > 0"),
        ("training.max_consecutive_skips", -1, "integer >= 0"),
        ("fault_tolerance.watchdog_timeout_seconds", 500.0, "shorter than comm.train_timeout"),
        ("fault_tolerance.watchdog_timeout_seconds", -1.0, "finite number >= 0"),
        ("fault_tolerance.straggler_margin", math.inf, "finite number >= 0"),
        ("fault_tolerance.straggler_log_steps", 0, "integer >= 1"),
    ],
)
def test_resilience_config_errors(field: str, value: object, match: str) -> None:
    cfg = JobConfig()
    validate_resilience(cfg)  # defaults pass
    section, name = field.split(".")
    setattr(getattr(cfg, section), name, value)
    with pytest.raises(ConfigError, match=match) as e:
        validate_resilience(cfg)
    assert field in str(e.value)
