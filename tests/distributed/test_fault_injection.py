"""Tier 3 (slow): faults injected with ``TORCHTITAN_FAULT`` (tools/fault_injection.py) on the
tiny debug model, 2 gloo ranks.

- a rank SIGKILLed at step 5 under ``torchrun --max-restarts 1``: the job restarts, resumes from
  step 3 and its step-6 checkpoint equals the fault-free run's bitwise;
- a rank hung at step 3: both ranks write their stacks to the watchdog folder well before the
  collective timeout;
- a rank slowed by a sleep before each batch: flagged as a straggler within 3 log steps;
- a loss spike on one rank: skip_step leaves the weights of that step unchanged on both ranks,
  rollback reloads step 3 and trains on;
- a diverging learning rate under nonfinite_policy skip_step aborts, with no NaN checkpoint.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.checkpoint_helpers import assert_checkpoints_identical, ckpt_argv, read_checkpoint
from tests.launcher import _worker, free_port, mp_context, run_ranks
from tests.parity import DEBUG_TOML, ROOT, TINY, read_jsonl

pytestmark = pytest.mark.slow
FSDP2 = ["--training.local_batch_size", "4"]


def _fsdp2_argv(steps: int, **fault_tolerance: object) -> list[str]:
    """TINY, FSDP 2, ``steps`` steps and ``--fault_tolerance.KEY VALUE`` for each keyword."""
    ft = [a for k, v in fault_tolerance.items() for a in (f"--fault_tolerance.{k}", str(v))]
    return [*TINY, *FSDP2, "--training.steps", str(steps), *ft]


def _train(argv: list[str], dump: str, fault: str, lr: float | None = None) -> dict[str, Any]:
    """Train with ``TORCHTITAN_FAULT=fault``; returns what the trainer saw. ``lr`` is set after
    the preflight, which refuses a learning rate above 1: the runtime guards must also hold for a
    config built in Python."""
    os.environ["TORCHTITAN_FAULT"] = fault
    from torchtitan.distributed.utils import destroy_distributed
    from torchtitan.preflight.validate import load_config
    from torchtitan.training.trainer import Trainer

    cfg = load_config(["--job.config_file", DEBUG_TOML, "--job.dump_folder", dump, *argv])
    if lr is not None:
        cfg.optimizer.lr = lr
    trainer = Trainer(cfg)
    try:
        trainer.train()
    finally:
        trainer.close()
        destroy_distributed()
    path = Path(dump) / "metrics" / f"rank_{os.environ['RANK']}.jsonl"
    return {
        "events": trainer.step_guard.events,
        "metrics": read_jsonl(path) if path.exists() else [],
        "stragglers": trainer.metrics.stragglers.flagged if trainer.metrics.stragglers else [],
    }


def _model(folder: Path) -> dict[str, Any]:
    return {k: v for k, v in read_checkpoint(folder).items() if k.startswith("model.")}


# warn (weights change, as they must) is covered by tests/unit/test_resilience.py; one
# parameter keeps this tier small.
@pytest.mark.parametrize("policy", ["skip_step"])
def test_spike_on_one_rank_triggers_the_policy_on_both(policy: str, tmp_path: Path) -> None:
    argv = [
        *ckpt_argv(*FSDP2, steps=5, interval=1),
        "--checkpoint.keep_latest_k", "0",
        "--training.spike_policy", policy,
        "--training.spike_warmup", "3",
    ]  # fmt: skip
    results = run_ranks(_train, 2, argv, str(tmp_path), "spike:step=5,rank=1,factor=50")
    for r in results:  # both ranks report the same event, naming rank 1
        (event,) = r["events"]
        assert event["step"] == 5 and event["rank"] == 1 and event["policy"] == policy
        assert float(event["score"]) > 6.0
    import torch

    before, after = (
        _model(tmp_path / "checkpoint" / "step-4"),
        _model(tmp_path / "checkpoint" / "step-5"),
    )
    same = all(torch.equal(before[k], after[k]) for k in before)
    assert same == (policy == "skip_step"), f"{policy}: weights of step 5 unchanged = {same}"


def test_spike_rollback_reloads_and_trains_on(tmp_path: Path) -> None:
    argv = [
        *ckpt_argv(*FSDP2, steps=6, interval=3),
        "--training.spike_policy", "rollback",
        "--training.spike_warmup", "3",
    ]  # fmt: skip
    results = run_ranks(_train, 2, argv, str(tmp_path), "spike:step=5,rank=0,factor=50")
    (event,) = results[0]["events"]
    assert event["step"] == 5 and event["rank"] == 0 and event["policy"] == "rollback"
    steps = [m["step"] for m in results[0]["metrics"]]
    assert steps == [1, 2, 3, 4, 4, 5, 6], steps  # step 5 spiked, back to 3, 4 trained again
    first4, again4 = (m["loss"] for m in results[0]["metrics"] if m["step"] == 4)
    assert first4 == again4, "the replayed step differs: the rollback did not restore step 3"
    assert (tmp_path / "checkpoint" / "step-6").is_dir()


def test_straggler_flagged_within_three_log_steps(tmp_path: Path) -> None:
    argv = _fsdp2_argv(4, straggler_margin=0.5, straggler_log_steps=3)
    results = run_ranks(_train, 2, argv, str(tmp_path), "slow:rank=1,seconds=0.3")
    flagged = results[0]["stragglers"]
    assert flagged and flagged[0] == (3, "data_time_s", 1), flagged
    assert results[1]["stragglers"] == flagged  # every rank sees the same view


def _hang_worker(argv: list[str], dump: str) -> None:
    _train(argv, dump, "hang:rank=1,step=3,seconds=120")


def test_hung_rank_makes_every_rank_dump_its_stacks(tmp_path: Path) -> None:
    argv = [*_fsdp2_argv(5, watchdog_timeout_seconds=3), "--comm.train_timeout_seconds", "60"]
    ctx, port = mp_context(), free_port()
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(_hang_worker, r, 2, port, (argv, str(tmp_path)), queue))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    dumps = [tmp_path / "watchdog" / f"rank_{r}_step_3.txt" for r in range(2)]
    start = time.monotonic()
    try:
        while time.monotonic() - start < 240 and not all(d.exists() for d in dumps):
            time.sleep(0.5)
        time.sleep(1.0)  # let the writers finish
        waited = time.monotonic() - start
    finally:
        for p in procs:
            p.kill()
            p.join()
    assert all(d.exists() for d in dumps), f"missing dumps after {waited:.0f} s"
    hung, waiting = dumps[1].read_text(), dumps[0].read_text()
    assert "fault_injection.py" in hung and "at_step_start" in hung  # where rank 1 is stuck
    assert "waiting in: training step" in waiting
    assert "torch/distributed" in waiting, waiting[:3000]  # rank 0 sits in a collective


def test_torchrun_restart_after_sigkill_matches_fault_free_run(tmp_path: Path) -> None:
    argv = ckpt_argv(*FSDP2, steps=6, interval=3)
    ref = tmp_path / "ref"
    run_ranks(_train, 2, argv, str(ref), "")
    dump = tmp_path / "killed"
    env = {
        **os.environ,
        "TORCHTITAN_FAULT": "kill:rank=1,step=5",
        "TORCHTITAN_DEVICE": "cpu",
        "OMP_NUM_THREADS": "1",
        # as run_train.sh sets it: restarted workers must not read the last attempt's store
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
        "-m", "torchtitan.train",
        "--job.config_file", DEBUG_TOML, "--job.dump_folder", str(dump), *argv,
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "fault injection: SIGKILL at the start of step 5" in log
    assert "resuming after step 3" in log, log[-4000:]
    assert_checkpoints_identical(ref / "checkpoint" / "step-6", dump / "checkpoint" / "step-6")


def _diverge(argv: list[str], dump: str) -> str:
    try:
        _train(argv, dump, "", lr=1e6)
    except Exception as e:  # noqa: BLE001 - the message is the result
        return f"{type(e).__name__}: {e}"
    return "finished"


def test_diverging_run_under_skip_step_aborts_without_nan_checkpoints(tmp_path: Path) -> None:
    """The issue's example: a learning rate that diverges under nonfinite_policy skip_step used
    to skip every step, save NaN checkpoints and end 'training done'."""
    import torch

    argv = [
        *ckpt_argv("--training.local_batch_size", "8", steps=30, interval=2),
        "--training.nonfinite_policy", "skip_step",
        "--training.max_consecutive_skips", "3",
    ]  # fmt: skip
    (out,) = run_ranks(_diverge, 1, argv, str(tmp_path))
    assert out.startswith("TrainingAborted"), out
    assert "non-finite" in out or "consecutive steps skipped" in out, out
    saved = sorted((tmp_path / "checkpoint").glob("step-*"))
    for folder in saved:
        for k, v in _model(folder).items():
            assert torch.isfinite(v).all(), f"{folder.name}: {k} is non-finite"
    print(f"aborted: {out[:200]}; {len(saved)} checkpoint(s), all finite")
