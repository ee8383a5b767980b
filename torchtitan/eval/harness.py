"""Running lm-eval tasks on a :class:`~torchtitan.eval.lm.TorchTitanLM` and reporting the scores,
from ``python -m torchtitan.eval`` or inside training every ``eval.freq`` steps
(docs/evaluation.md).

:class:`Evaluator` resolves the tasks once (``eval/tasks.py``), runs lm-eval's
``simple_evaluate`` on every rank (each rank sees all documents; the LM splits the requests
over data-parallel ranks), logs one line per task and writes the scores to the metric writers
(JSONL, TensorBoard, W&B) at the step, as ``eval/<task>/<metric>`` plus ``eval/time_s``.
lm-eval is imported only here and in ``eval/lm.py``, when an evaluation is built.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from typing import Any

from torch import nn

from torchtitan.config.job_config import Eval
from torchtitan.eval.tasks import resolve_tasks, task_manager
from torchtitan.metrics.writers import MetricWriter
from torchtitan.tools.logging import logger

__all__ = ["Evaluator", "make_lm", "run_tasks", "scores"]


def run_tasks(
    lm: Any, specs: list[Any], cfg: Eval, log_samples: bool = False, seed: int = 1234
) -> dict[str, Any]:
    """lm-eval's result dict for ``specs`` (from :func:`resolve_tasks`) on ``lm``."""
    from lm_eval import evaluator

    # Every rank is one whole lm-eval process (the LM splits requests itself), but lm-eval
    # returns results only where LOCAL_RANK is 0: show it that on every rank, for this call.
    local_rank = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = "0"
    try:
        out = evaluator.simple_evaluate(
            model=lm,
            tasks=specs,
            num_fewshot=None if cfg.num_fewshot < 0 else cfg.num_fewshot,
            limit=None if cfg.limit < 0 else cfg.limit,
            task_manager=task_manager(cfg.include_path),
            log_samples=log_samples,
            bootstrap_iters=0,
            random_seed=seed,
            numpy_random_seed=seed,
            torch_random_seed=seed,
            fewshot_random_seed=seed,
        )
    finally:
        if local_rank is None:
            del os.environ["LOCAL_RANK"]
        else:
            os.environ["LOCAL_RANK"] = local_rank
    assert out is not None
    return dict(out)


def scores(results: dict[str, Any]) -> dict[str, float]:
    """``{"eval/<task>/<metric>": value}`` for every numeric score (stderr left out); lm-eval's
    ``"acc,none"`` keys lose their filter suffix when it is ``none``."""
    flat: dict[str, float] = {}
    for task, metrics in sorted(results.get("results", {}).items()):
        for key, value in metrics.items():
            if "," not in key or "_stderr" in key or not isinstance(value, (int, float)):
                continue  # name, alias, sample_len, stderr
            metric, _, filt = key.partition(",")
            name = metric if filt in ("", "none") else f"{metric}_{filt}"
            flat[f"eval/{task}/{name}"] = float(value)
    return flat


class Evaluator:
    """Evaluates ``lm`` on ``cfg.tasks``; ``model_parts`` are put in eval mode meanwhile."""

    def __init__(
        self,
        lm: Any,
        cfg: Eval,
        writers: Sequence[MetricWriter] = (),
        model_parts: Sequence[nn.Module] = (),
        seed: int = 1234,
    ) -> None:
        self.lm = lm
        self.cfg = cfg
        self.writers = list(writers)
        self.model_parts = list(model_parts)
        self.seed = seed
        self.specs = resolve_tasks(cfg.tasks, cfg.include_path)
        self.last_results: dict[str, Any] = {}

    def should_evaluate(self, step: int) -> bool:
        return self.cfg.freq > 0 and step % self.cfg.freq == 0

    def evaluate(self, step: int, log_samples: bool = False) -> dict[str, float]:
        """Run every task once; log, write and return the scores (and ``eval/time_s``)."""
        start = time.perf_counter()
        was_training = [m.training for m in self.model_parts]
        for m in self.model_parts:
            m.eval()
        try:
            self.last_results = run_tasks(self.lm, self.specs, self.cfg, log_samples, self.seed)
        finally:
            for m, mode in zip(self.model_parts, was_training):
                m.train(mode)
        metrics = scores(self.last_results)
        elapsed = time.perf_counter() - start
        n = self.last_results.get("n-samples", {})
        for task in sorted(self.last_results.get("results", {})):
            shown = "  ".join(
                f"{k.rsplit('/', 1)[1]} {v:.4f}"
                for k, v in metrics.items()
                if k.startswith(f"eval/{task}/") and math.isfinite(v)
            )
            docs = n.get(task, {}).get("effective", "?")
            logger.info(f"eval step {step:>6}  {task}: {shown}  ({docs} docs)")
        logger.info(f"eval step {step:>6}  {len(self.specs)} task(s) in {elapsed:.1f} s")
        metrics["eval/time_s"] = elapsed
        for w in self.writers:
            w.log(dict(metrics), step)
        return metrics


def make_lm(
    model: nn.Module,
    tokenizer: Any,
    max_length: int,
    device: Any,
    cfg: Eval,
    dp: tuple[Any, int, int] = (None, 0, 1),
) -> Any:
    """The lm-eval ``LM`` over ``model`` (imports lm-eval). ``dp``: the (group, rank, size)
    requests are split over; the default evaluates every request on every rank."""
    from torchtitan.eval.lm import TorchTitanLM

    group, rank, size = dp
    return TorchTitanLM(
        model,
        tokenizer,
        max_length,
        device,
        batch_size=cfg.batch_size,
        max_gen_toks=cfg.max_gen_tokens,
        dp_group=group,
        dp_rank=rank,
        dp_size=size,
    )


def training_evaluator(
    cfg: Eval,
    model_parts: Sequence[nn.Module],
    tokenizer: Any,
    seq_len: int,
    device: Any,
    writers: Sequence[MetricWriter],
    seed: int,
) -> Evaluator:
    """lm-eval tasks on the model being trained, every ``eval.freq`` steps (docs/evaluation.md).
    Every rank evaluates every request: under FSDP the ranks' forwards must pair up."""
    lm = make_lm(model_parts[0], tokenizer, seq_len, device, cfg)
    return Evaluator(lm, cfg, writers, model_parts=model_parts, seed=seed)
