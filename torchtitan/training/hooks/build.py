"""The loop's hooks of a run, in the order the loop calls them (docs/architecture.md, section 3):
before a step gc, watchdog beat, fault injection; after it (and its metrics) validation,
evaluation, profiler, checkpoint (which may stop the loop), the training timeout after step 1.
A feature the config leaves off has no hook."""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh

from torchtitan.checkpoint.manager import CheckpointManager
from torchtitan.config.job_config import JobConfig
from torchtitan.eval.harness import Evaluator
from torchtitan.eval.validation_loss import Validator
from torchtitan.tools.fault_injection import Faults
from torchtitan.tools.profiling import Profiling
from torchtitan.tools.watchdog import Watchdog
from torchtitan.training.hooks.base import OffStepTime, StepHook
from torchtitan.training.hooks.checkpoint import CheckpointHook
from torchtitan.training.hooks.comm import CommTimeoutHook
from torchtitan.training.hooks.faults import FaultsHook
from torchtitan.training.hooks.gc import GcHook
from torchtitan.training.hooks.periodic import PeriodicHook
from torchtitan.training.hooks.profiler import ProfilerHook
from torchtitan.training.hooks.watchdog import WatchdogHook


def build_hooks(
    cfg: JobConfig,
    timing: OffStepTime,
    watchdog: Watchdog | None,
    faults: Faults,
    between_steps: tuple[Validator | None, Evaluator | None, Profiling],
    checkpoint: tuple[CheckpointManager, int] | None,
    world_mesh: DeviceMesh,
) -> list[StepHook]:
    """``checkpoint``: the manager and the global tokens of a step (saved with the step)."""
    validator, evaluator, profiling = between_steps
    hooks: list[StepHook] = []
    if cfg.training.gc_freq > 0:
        hooks.append(GcHook(cfg.training.gc_freq))
    if watchdog is not None:
        hooks.append(WatchdogHook(watchdog))
    hooks.append(FaultsHook(faults))
    if validator is not None:
        hooks.append(
            PeriodicHook(validator.should_validate, validator.validate, "validation", timing)
        )
    if evaluator is not None:
        phase = "evaluation (lm-eval tasks)"
        hooks.append(PeriodicHook(evaluator.should_evaluate, evaluator.evaluate, phase, timing))
    hooks.append(ProfilerHook(profiling))
    if checkpoint is not None:
        hooks.append(CheckpointHook(*checkpoint, timing))
    hooks.append(CommTimeoutHook(cfg.comm.train_timeout_seconds, world_mesh))
    return hooks
