"""The ``[eval]`` section (docs/evaluation.md): numbers in range, lm-eval installed, and every
task known, its local files present and its data readable offline, before any model work.

Training checks the tasks only when ``eval.freq`` turns evaluation on; ``python -m
torchtitan.eval`` always does (``standalone``). Resolving tasks indexes lm-eval's task folders
(a few seconds), so it runs only when evaluation will run.
"""

from __future__ import annotations

import importlib.util

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig
from torchtitan.eval.tasks import resolve_tasks


def validate_eval(cfg: JobConfig, standalone: bool = False) -> None:
    e = cfg.eval  # numbers in range: preflight/validate_values.py
    if not (standalone or e.freq > 0):
        return
    if not e.tasks:
        raise ConfigError(
            "eval.tasks",
            e.tasks,
            "is empty but evaluation is on",
            "name tasks, e.g. --eval.tasks torchtitan_facts_mc,torchtitan_facts_gen",
        )
    if importlib.util.find_spec("lm_eval") is None:
        raise ConfigError(
            "eval.tasks",
            e.tasks,
            "evaluation needs lm-evaluation-harness, which is not installed",
            "pip install 'torchtitan[eval]' (or lm-eval)",
        )
    if e.freq > 0:
        p = cfg.parallelism
        if p.pipeline_parallel_degree > 1 or p.context_parallel_degree > 1:
            raise ConfigError(
                "eval.freq",
                e.freq,
                "in-training evaluation runs the whole model on each rank's tensor-parallel "
                "group; pipeline and context parallel are not supported",
                "set eval.freq 0 and evaluate the checkpoints with python -m torchtitan.eval",
            )
        if cfg.training.loss_chunk_size > 0:
            raise ConfigError(
                "eval.freq",
                e.freq,
                "in-training evaluation needs logits, and training.loss_chunk_size > 0 makes "
                "the model return hidden states",
                "set training.loss_chunk_size 0, or eval.freq 0 and evaluate checkpoints",
            )
    resolve_tasks(e.tasks, e.include_path)
