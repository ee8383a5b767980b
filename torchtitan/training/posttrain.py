"""The Trainer of the post-training modes (``training.mode = "dpo" | "grpo"``; docs/posttrain.md,
"Running"): everything the Trainer builds (layouts, optimizer, schedule, metrics, checkpoints),
with the mode's data (``_build_data``) and step (``_build_step``: :class:`DpoStep` or
:class:`GrpoStep`) in place of the language-model ones, and the reference's shards and the
sampling generator checkpointed beside the model (``_checkpoint_extra``).

Chosen by ``torchtitan/train.py`` from ``training.mode``; the config was validated by
``preflight/validate_posttrain.py``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from torchtitan.config.sections import POSTTRAIN_PART
from torchtitan.data.tokenizer import build_tokenizer
from torchtitan.guards.nonfinite import NonFiniteGuard
from torchtitan.metrics.processor import MetricsProcessor
from torchtitan.posttrain.dpo import DpoSettings, DpoStep
from torchtitan.posttrain.grpo import GrpoSettings, GrpoStep, read_prompts
from torchtitan.posttrain.loaders import PosttrainState, PreferenceLoader, PromptLoader
from torchtitan.posttrain.preference_data import PreferenceDataset
from torchtitan.posttrain.reference import Reference
from torchtitan.posttrain.rewards import resolve
from torchtitan.tools.paths import resolve_repo_path
from torchtitan.training.trainer import Trainer


@dataclass
class PosttrainSteps:
    """The loop's step object for a post-training mode: draws the step's data, runs the mode's
    step (the non-finite guard decides whether the optimizer steps) and keeps its metrics for
    the log (``fields``, under ``<mode>/``)."""

    mode: str
    step: DpoStep | GrpoStep
    loader: PreferenceLoader | PromptLoader
    grad_accum_steps: int
    metrics: MetricsProcessor
    nonfinite: NonFiniteGuard
    rollback_pending: bool = False  # the spike policies are refused for these modes
    last: dict[str, float] = field(default_factory=dict)

    def run(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.step.before_update = lambda loss, norm: self._guard(step, loss, norm)
        start = time.perf_counter()
        if isinstance(self.step, DpoStep):
            assert isinstance(self.loader, PreferenceLoader)
            batches = self.loader.next_batches(self.grad_accum_steps)
            self.metrics.add_data_time(time.perf_counter() - start)
            self.last = self.step.run(batches)
            loss = self.last["loss"]
        else:
            assert isinstance(self.loader, PromptLoader)
            self.last = self.step.run(self.loader.next_prompts())
            assert self.step.last_loss is not None
            loss = float(self.step.last_loss)
        return torch.tensor(loss), torch.tensor(self.last["grad_norm"])

    def _guard(self, step: int, loss: torch.Tensor, norm: torch.Tensor) -> bool:
        ok = self.nonfinite.check(step, loss, norm, self.step.parts)
        self.metrics.skipped_steps = self.nonfinite.skipped_steps
        return ok

    def fields(self) -> tuple[dict[str, float | int | None], str]:
        shown = {k: v for k, v in self.last.items() if k not in ("loss", "grad_norm")}
        text = "".join(f"  {k} {v:.4g}" for k, v in shown.items())
        return {f"{self.mode}/{k}": v for k, v in shown.items()}, text

    def rollback(self, bad: int) -> int | None:  # never pending (see rollback_pending)
        raise AssertionError("no rollback in the post-training modes")


class PosttrainTrainer(Trainer):
    def _build_data(self) -> None:
        cfg, dims, t = self.cfg, self.parallel_dims, self.cfg.training
        self.tokenizer = build_tokenizer(cfg.model.tokenizer_path)
        dp = dims.get_mesh("dp")
        if t.mode == "dpo":
            ds = PreferenceDataset(
                resolve_repo_path(cfg.dpo.dataset_path), self.tokenizer, t.seq_len,
                dp.get_local_rank(), dp.size(),
            )  # fmt: skip
            self.dataloader = PreferenceLoader(ds, t.local_batch_size)  # type: ignore[assignment]
            self.batch = dims.batch_sizes(t.local_batch_size, t.global_batch_size)
            rows = 2 * t.local_batch_size * self.batch.grad_accum_steps  # chosen + rejected
        else:
            g = cfg.grpo
            prompts = read_prompts(
                resolve_repo_path(g.prompts_path), self.tokenizer, t.seq_len, g.max_new_tokens
            )
            self.dataloader = PromptLoader(  # type: ignore[assignment]
                prompts, g.prompts_per_step, dp.get_local_rank(), dp.size()
            )
            per_rank = g.prompts_per_step // dp.size()
            self.batch = dims.batch_sizes(per_rank * g.k, -1)  # k completions of each prompt
            rows = per_rank * g.k
        self.grad_accum_steps = self.batch.grad_accum_steps
        self.tokens_per_step = rows * t.seq_len  # padded rows (an upper bound for GRPO)
        self.device_tokens_per_step = self.tokens_per_step // dims.non_data_parallel_size
        self.global_tokens_per_step = self.tokens_per_step * dp.size()

    def _reference_kind(self) -> bool | None:
        """True: a frozen copy; False: the adapters off; None: no reference."""
        cfg = self.cfg
        if cfg.training.mode == "dpo":
            if cfg.dpo.loss_type == "simpo":
                return None
            choice = cfg.dpo.reference
        else:
            if cfg.grpo.kl_coef == 0:
                return None
            choice = "auto"
        if choice == "auto":
            return not cfg.lora.enable
        return choice == "frozen_copy"

    def _checkpoint_extra(self) -> dict[str, Any]:
        self.posttrain_state = PosttrainState(self.model_parts, self.rank)
        self.posttrain_state.wants_reference = self._reference_kind() is True
        self.posttrain_state.wants_generator = self.cfg.training.mode == "grpo"
        return {POSTTRAIN_PART: self.posttrain_state}

    def _build_step(self) -> None:
        cfg, parts = self.cfg, self.model_parts
        dp = self.parallel_dims.get_mesh("dp")
        kind = self._reference_kind()
        # Taken from the weights training starts from; a resume then loads the saved copy.
        reference = None if kind is None else Reference(parts, frozen=kind)
        generator = None
        common = (parts, self.optimizer, self.lr_scheduler)
        step: DpoStep | GrpoStep
        if cfg.training.mode == "dpo":
            d = cfg.dpo
            settings = DpoSettings(d.loss_type, d.beta, d.label_smoothing, d.simpo_gamma)
            step = DpoStep(*common, settings, reference, dp, self.device, cfg.training.max_norm)
        else:
            g = cfg.grpo
            generator = torch.Generator().manual_seed(g.seed + dp.get_local_rank())
            settings_g = GrpoSettings(
                g.k, g.max_new_tokens, g.temperature, g.top_k, g.kl_coef, g.epsilon_low,
                g.epsilon_high, g.loss_type, g.scale_rewards,
            )  # fmt: skip
            step = GrpoStep(
                *common, settings_g, [resolve(r) for r in g.rewards],
                g.reward_weights or [1.0] * len(g.rewards), self.tokenizer, reference, dp,
                self.device, generator, cfg.training.max_norm,
            )  # fmt: skip
        if not hasattr(self, "posttrain_state"):  # checkpointing off
            self.posttrain_state = PosttrainState(parts, self.rank)
        self.posttrain_state.attach(reference, generator)
        self.stepper = PosttrainSteps(  # type: ignore[assignment]
            cfg.training.mode, step, self.dataloader, self.grad_accum_steps,  # type: ignore[arg-type]
            self.metrics, self.nonfinite,
        )  # fmt: skip
        self.metrics.extra_fields.append(self.stepper.fields)  # type: ignore[attr-defined]
