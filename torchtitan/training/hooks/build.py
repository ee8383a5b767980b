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
from torchtitan.training.hooks.evaluation import EvaluationHook
from torchtitan.training.hooks.faults import FaultsHook
from torchtitan.training.hooks.gc import GcHook
from torchtitan.training.hooks.profiler import ProfilerHook
from torchtitan.training.hooks.validation import ValidationHook
from torchtitan.training.hooks.watchdog import WatchdogHook


def build_hooks(
    cfg: JobConfig,
    timing: OffStepTime,
    *,
    watchdog: Watchdog | None,
    faults: Faults,
    validator: Validator | None,
    evaluator: Evaluator | None,
    profiling: Profiling,
    checkpointer: CheckpointManager | None,
    global_tokens_per_step: int,
    world_mesh: DeviceMesh,
) -> list[StepHook]:
    hooks: list[StepHook] = []
    if cfg.training.gc_freq > 0:
        hooks.append(GcHook(cfg.training.gc_freq))
    if watchdog is not None:
        hooks.append(WatchdogHook(watchdog))
    hooks.append(FaultsHook(faults))
    if validator is not None:
        hooks.append(ValidationHook(validator, timing))
    if evaluator is not None:
        hooks.append(EvaluationHook(evaluator, timing))
    hooks.append(ProfilerHook(profiling))
    if checkpointer is not None:
        hooks.append(CheckpointHook(checkpointer, global_tokens_per_step, timing))
    hooks.append(CommTimeoutHook(cfg.comm.train_timeout_seconds, world_mesh))
    return hooks
