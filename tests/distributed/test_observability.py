"""Tier 3: observability on the real trainer (issue #8).

- memory: a healthy run stays quiet and labels warm-up (the seed's steps-1-and-10 view included);
  a run with a hook that keeps every step's logits is flagged within a bounded number of steps;
- cross-rank view: a data straggler and a memory outlier on rank 1 are named in rank 0's metrics;
- validation: the same validation loss on 2 FSDP ranks as on 1 process, in JSONL, TensorBoard
  and W&B, without changing the training losses; profiler traces per rank;
- non-finite: a NaN injected into one rank's gradient shard is reported with the step, the rank
  and the parameter (raise), or the step is skipped on every rank and counted (skip_step).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.launcher import run_ranks
from tests.parity import DEBUG_TOML, TINY, assert_losses_match, read_jsonl

STEPS = 4
NAN_STEP = 3
NAN_PARAM = "layers.2.feed_forward.w1.weight"
LEAK_FROM = 6
LEAK_WINDOW = 12


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class _Slow:
    """A slow data pipeline: every batch takes ``delay`` seconds longer."""

    def __init__(self, it: Any, delay: float) -> None:
        self.it, self.delay = it, delay

    def __iter__(self) -> _Slow:
        return self

    def __next__(self) -> Any:
        time.sleep(self.delay)
        return next(self.it)


def _run(argv: list[str], dump: str, hooks: dict[str, Any]) -> dict[str, Any]:
    """Build the trainer (with test-only hooks), train, and return what rank r wrote and logged."""
    from torchtitan.guards.nonfinite import NonFiniteError
    from torchtitan.preflight.validate import load_config
    from torchtitan.tools.logging import logger
    from torchtitan.training.trainer import Trainer

    cfg = load_config(["--job.config_file", DEBUG_TOML, "--job.dump_folder", dump, *TINY, *argv])
    rank = int(os.environ["RANK"])
    capture = _Capture()
    logger.addHandler(capture)
    out: dict[str, Any] = {"checksums": {}, "error": None}
    kept: list[torch.Tensor] = []

    class Hooked(Trainer):
        def __init__(self, cfg: Any) -> None:
            super().__init__(cfg)
            if hooks.get("hog_mib") and rank == 1:
                self.hog = torch.ones(hooks["hog_mib"] * 2**18)  # held for the whole run
            if hooks.get("straggle_s") and rank == 1:
                self.stepper.data_iter = _Slow(iter(self.dataloader), hooks["straggle_s"])
            if hooks.get("leak"):
                # The bug being simulated: a hook that keeps every step's logits (4 MiB here).
                def keep(module: Any, args: Any, output: torch.Tensor) -> None:
                    if self.step >= LEAK_FROM:
                        kept.append(output.detach().clone())

                self.model.output.register_forward_hook(keep)  # type: ignore[union-attr]
            if hooks.get("nan"):
                self.runner.forward_backward = self._nan_after(self.runner.forward_backward)

        def _nan_after(self, forward_backward):  # type: ignore[no-untyped-def]
            def run(batch, loss_factor=1.0):  # type: ignore[no-untyped-def]
                loss = forward_backward(batch, loss_factor)
                if self.step == NAN_STEP and rank == 1:
                    for name, p in self.model.named_parameters():
                        if name == NAN_PARAM and p.grad is not None:
                            local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                            local.view(-1)[0] = float("nan")
                return loss

            return run

        def train_step(self):  # type: ignore[no-untyped-def]
            result = super().train_step()
            with torch.no_grad():
                total = sum(
                    float((p.to_local() if hasattr(p, "to_local") else p).double().sum())
                    for p in self.model.parameters()
                )
            out["checksums"][self.step] = total
            return result

    trainer = Hooked(cfg)
    try:
        trainer.train()
    except NonFiniteError as e:
        out["error"] = str(e)
    finally:
        leak = trainer.metrics.memory_monitor.leak
        out["leak"] = None if leak is None else (leak.flagged_step, leak.start_step, leak.rank)
        trainer.close()
        logger.removeHandler(capture)
        if trainer.optimizer.state:
            out["optimizer_steps"] = sorted(
                {int(s["step"]) for s in trainer.optimizer.state.values() if "step" in s}
            )
    dump_path = Path(dump)
    metrics = dump_path / "metrics" / f"rank_{rank}.jsonl"
    memory = dump_path / "memory" / f"rank_{rank}.jsonl"
    out["metrics"] = read_jsonl(metrics) if metrics.exists() else []
    out["memory"] = read_jsonl(memory) if memory.exists() else []
    out["messages"] = capture.messages
    return out


def _train_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "loss" in r]


def _val_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "validation/loss" in r]


def _leak_warnings(messages: list[str]) -> list[str]:
    return [m for m in messages if "leak suspected" in m]


# ---------------------------------------------------------------- memory monitor


def test_training_run_is_quiet_and_warmup_is_labelled(tmp_path: Path) -> None:
    """The seed's scenario: log_freq 10, so memory is seen at steps 1 and 10 (and 20, 30) only."""
    argv = ["--training.steps", "24", "--metrics.log_freq", "10"]
    argv += ["--metrics.memory_leak_window", str(LEAK_WINDOW)]
    (r,) = run_ranks(_run, 1, argv, str(tmp_path), {})
    assert not _leak_warnings(r["messages"]), _leak_warnings(r["messages"])
    rows = _train_rows(r["metrics"])
    assert [m["step"] for m in rows] == [1, 10, 20, 24]
    print({m["step"]: (m["memory/current_gib"], m.get("memory/heap_gib")) for m in rows})
    assert rows[0]["memory/warmup"] == 1 and rows[1]["memory/warmup"] == 0
    assert all(m["memory/leak_mib_per_step"] == 0.0 for m in rows)
    # Whatever rose between the step-1 and step-10 lines happened in warm-up: after it, the
    # tracked memory (CPU: the C heap in use) is flat to within 4 MiB.
    assert all(abs(m["memory/growth_since_warmup_gib"]) * 1024 < 4 for m in rows[1:]), rows
    (warm,) = [m for m in r["messages"] if m.startswith("memory warm-up")]
    assert "steps 1-3" in warm
    logged = [m for m in r["messages"] if m.startswith("step ")]
    assert "[warm-up]" in logged[0] and "[warm-up]" not in logged[1]
    assert [m["step"] for m in r["memory"]] == list(range(1, 25))  # every step, not log steps
    assert [m["warmup"] for m in r["memory"]] == [True] * 3 + [False] * 21


def test_injected_leak_is_flagged_with_rank_rate_and_start(tmp_path: Path) -> None:
    steps = LEAK_FROM + LEAK_WINDOW + 3
    argv = ["--training.steps", str(steps), "--metrics.log_freq", "10"]
    argv += ["--metrics.memory_leak_window", str(LEAK_WINDOW)]
    (r,) = run_ranks(_run, 1, argv, str(tmp_path), {"leak": True})
    warnings = _leak_warnings(r["messages"])
    assert len(warnings) == 1, warnings
    print(warnings[0])
    logits_mib = 8 * 64 * 2048 * 4 / 2**20  # local batch x seq x vocab x fp32
    assert "rank 0" in warnings[0]
    rate = float(warnings[0].split("growing by ")[1].split(" MiB/step")[0])
    start = int(warnings[0].split("since step ")[1].split(" ")[0])
    assert rate == pytest.approx(logits_mib, rel=0.25), warnings[0]
    assert abs(start - LEAK_FROM) <= 2, warnings[0]
    flagged_at, start_step, leak_rank = r["leak"]
    assert leak_rank == 0 and start_step == start
    assert flagged_at <= LEAK_FROM + LEAK_WINDOW + 3, f"flagged only at step {flagged_at}"
    last = _train_rows(r["metrics"])[-1]
    assert last["memory/leak_mib_per_step"] == pytest.approx(logits_mib, rel=0.25)


# ---------------------------------------------------------------- cross-rank view, validation


VAL = ["--validation.enable", "--validation.freq", "2", "--validation.steps", "2"]


@pytest.fixture(scope="module")
def single_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    argv = ["--training.steps", str(STEPS), "--training.local_batch_size", "8", *VAL]
    (r,) = run_ranks(_run, 1, argv, str(tmp_path_factory.mktemp("ref")), {})
    return r


@pytest.mark.slow
def test_cross_rank_view_validation_writers_profiler(
    single_process: dict[str, Any], tmp_path: Path
) -> None:
    pytest.importorskip("wandb")
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ["WANDB_SILENT"] = "true"
    argv = ["--training.steps", str(STEPS), "--training.local_batch_size", "4", *VAL]
    argv += ["--metrics.log_freq", "2", "--metrics.enable_tensorboard", "--metrics.enable_wandb"]
    argv += ["--metrics.save_for_all_ranks"]
    argv += ["--profiling.enable_profiling", "--profiling.profile_freq", "2"]
    argv += ["--profiling.profiler_warmup", "1"]
    hooks = {"straggle_s": 0.2, "hog_mib": 512}
    r0, r1 = run_ranks(_run, 2, argv, str(tmp_path), hooks)

    # Training and validation match one process (the hooks and observers change no numbers).
    ref = single_process["metrics"]
    got = _train_rows(r0["metrics"])
    ref_at = {m["step"]: m["loss"] for m in _train_rows(ref)}
    assert [m["step"] for m in got] == [1, 2, 4]
    assert_losses_match(
        [ref_at[m["step"]] for m in got],
        [m["loss"] for m in got],
        rtol=1e-5,
        label="FSDP 2 with validation + profiler (train loss)",
    )
    ref_val, got_val = _val_rows(ref), _val_rows(r0["metrics"])
    assert [m["step"] for m in got_val] == [2, 4] == [m["step"] for m in ref_val]
    assert_losses_match(
        [m["validation/loss"] for m in ref_val],
        [m["validation/loss"] for m in got_val],
        rtol=1e-5,
        label="FSDP 2 validation loss",
    )
    for m in got_val:
        assert m["validation/perplexity"] == pytest.approx(2.718281828 ** m["validation/loss"])
        assert m["validation/tokens"] == 2 * 8 * 64  # 2 batches of the global 8 x 64 tokens
    assert [m["validation/loss"] for m in _val_rows(r1["metrics"])] == [
        m["validation/loss"] for m in got_val
    ]

    # Cross-rank view: rank 0's own numbers cannot hide rank 1's straggling and memory.
    for m in _train_rows(r0["metrics"])[1:]:  # after step 1
        print({k: v for k, v in m.items() if k.startswith("ranks/")})
        assert m["ranks/data_time_s_max_rank"] == 1 and m["ranks/data_time_s_max"] >= 0.15
        assert m["ranks/data_time_s_min"] < 0.1 and m["ranks/data_time_s_min_rank"] == 0
        assert m["data_time_s"] < 0.1  # rank 0's own value looks healthy
        assert m["ranks/memory_peak_gib_max_rank"] == 1
        gap = m["ranks/memory_peak_gib_max"] - m["ranks/memory_peak_gib_min"]
        assert gap > 0.3, gap  # the 512 MiB rank 1 holds, less rank 0's writers (~70 MiB)
        assert m["ranks/step_time_s_min"] <= m["ranks/step_time_s_max"]
    line = [msg for msg in r0["messages"] if msg.startswith("step      4")][0]
    print(line)
    assert "ranks: step" in line and "(max r1)" in line

    # Writers: TensorBoard (read back by TensorBoard itself), W&B offline, JSONL on all ranks.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for rank in (0, 1):
        acc = EventAccumulator(str(tmp_path / "tb" / f"rank_{rank}"))
        acc.Reload()
        tags = set(acc.Tags()["scalars"])
        assert {"loss", "validation/loss", "validation/perplexity"} <= tags
        assert {"ranks/step_time_s_max", "memory/peak_gib", "memory/warmup"} <= tags
        assert [e.step for e in acc.Scalars("validation/loss")] == [2, 4]
    run_files = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 2, run_files
    for f in run_files:
        data = f.read_bytes()
        assert b"validation/loss" in data and b"ranks/data_time_s_max" in data
    assert _train_rows(r1["metrics"]), "save_for_all_ranks: rank 1 writes too"

    # Profiler: per-rank Chrome traces of the steps ending on multiples of profile_freq.
    for step in (2, 4):
        for rank in (0, 1):
            trace = tmp_path / "profile_traces" / f"iteration_{step}" / f"rank{rank}_trace.json"
            assert trace.exists(), trace
            events = json.loads(trace.read_text())["traceEvents"]
            assert any("ProfilerStep" in str(e.get("name")) for e in events)


@pytest.mark.slow
def test_validation_under_pipeline_parallel(single_process: dict[str, Any], tmp_path: Path) -> None:
    """Interleaved1F1B: 4 stages on 2 ranks; only the last stage computes the validation loss,
    every rank logs it."""
    argv = ["--training.steps", str(STEPS), "--training.local_batch_size", "8", *VAL]
    argv += ["--parallelism.pipeline_parallel_degree", "2"]
    argv += ["--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"]
    argv += ["--metrics.save_for_all_ranks"]
    r0, r1 = run_ranks(_run, 2, argv, str(tmp_path), {})
    ref = [m["validation/loss"] for m in _val_rows(single_process["metrics"])]
    for r in (r0, r1):
        rows = _val_rows(r["metrics"])
        assert [m["step"] for m in rows] == [2, 4]
        assert all(m["validation/tokens"] == 2 * 8 * 64 for m in rows)
        got = [m["validation/loss"] for m in rows]
        assert_losses_match(ref, got, rtol=1e-5, label="PP validation loss")


# ---------------------------------------------------------------- non-finite detection


def test_nonfinite_raise_names_step_rank_and_parameter(tmp_path: Path) -> None:
    argv = ["--training.steps", "5", "--training.local_batch_size", "4"]
    r0, r1 = run_ranks(_run, 2, argv, str(tmp_path), {"nan": True})
    for r in (r0, r1):
        assert r["error"] is not None, "no NonFiniteError"
        assert f"step {NAN_STEP}" in r["error"] and NAN_PARAM in r["error"]
        assert "on rank 1" in r["error"], r["error"]
        assert sorted(r["checksums"]) == [1, 2]  # stopped in step 3, before its optimizer step
    print(r0["error"])


def test_nonfinite_skip_step_keeps_weights_and_counts(
    single_process: dict[str, Any], tmp_path: Path
) -> None:
    argv = ["--training.steps", "5", "--training.local_batch_size", "4"]
    argv += ["--training.nonfinite_policy", "skip_step"]
    r0, r1 = run_ranks(_run, 2, argv, str(tmp_path), {"nan": True})
    for r in (r0, r1):
        assert r["error"] is None
        c = r["checksums"]
        assert c[NAN_STEP] == c[NAN_STEP - 1], "the weights changed in the skipped step"
        assert c[NAN_STEP + 1] != c[NAN_STEP] and c[2] != c[1], "the other steps must train"
        assert r["optimizer_steps"] == [4]  # 5 steps, one skipped
        assert any("optimizer step skipped" in m and NAN_PARAM in m for m in r["messages"])
    rows = _train_rows(r0["metrics"])
    assert [m["skipped_steps"] for m in rows] == [0, 0, 1, 1, 1]
    # Steps before the NaN trained exactly like one process.
    ref = [m["loss"] for m in _train_rows(single_process["metrics"])][:NAN_STEP]
    assert_losses_match(ref, [m["loss"] for m in rows][:NAN_STEP], rtol=1e-5, label="pre-NaN")
