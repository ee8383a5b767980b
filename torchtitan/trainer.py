"""The Trainer: builds everything in the order of docs/architecture.md (section 3), then runs
the loop.

Read top-down: ``__init__`` is the build order (one named step each; the builders themselves
are in ``torchtitan/builders.py``), ``train_step`` is one optimizer step with gradient
accumulation, ``train`` is the loop with metrics at ``log_freq``.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor.parallel import loss_parallel

from torchtitan.builders import (
    build_checkpointer,
    build_meta_model,
    build_metrics,
    build_model_parts,
    build_profiling,
    build_rank_dataloader,
    peak_flops,
)
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.chunked_loss import build_chunked_loss
from torchtitan.components.loss import cross_entropy_sum, global_loss_scale, unmasked_tokens
from torchtitan.components.lr_scheduler import build_lr_scheduler
from torchtitan.components.metrics_writers import MetricWriter
from torchtitan.components.nonfinite import NonFiniteGuard
from torchtitan.components.optimizer import build_optimizer
from torchtitan.components.spikes import StepGuard
from torchtitan.components.tokenizer import build_tokenizer
from torchtitan.components.validation_loss import Validator
from torchtitan.config.job_config import JobConfig
from torchtitan.config.manager import to_toml
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.compile import compile_loss, set_compile_cache_dir
from torchtitan.distributed.context_parallel import ContextParallel
from torchtitan.distributed.float8 import register_float8_precompute_hook
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.pipeline_parallel import Pipeline, build_pipeline
from torchtitan.models import MODELS, runtime_args
from torchtitan.models.common.attention import document_positions, resolve_attn_backend
from torchtitan.models.common.moe import moe_overrides, set_aux_loss_scale, update_expert_bias
from torchtitan.models.common.moe_metrics import ExpertLoadMetrics
from torchtitan.preflight.validate import pipeline_plan
from torchtitan.tools.fault_injection import parse_faults
from torchtitan.tools.logging import init_logger, logger
from torchtitan.tools.watchdog import Watchdog, configure_flight_recorder

ModelInputs = dict[str, torch.Tensor]
"""Keyword inputs of the model's forward beyond the tokens (``doc_ids``, ``positions``)."""


class Trainer:
    preempted_at: int | None = None  # the step after which a preemption signal stopped train()

    def __init__(self, cfg: JobConfig) -> None:
        """Build in order; the config was validated before we got here."""
        self.cfg = cfg
        self._init_distributed()  # process group, mesh, pipeline plan, log prefix, seeds
        self._build_data()  # tokenizer, data loader, batch plan
        self._build_model()  # meta model, converters, parallelisms, weights, pipeline, CP
        self._build_optimizer()  # optimizer and LR schedule
        self._build_observability()  # metrics, non-finite guard, validation, profiler
        self._build_checkpointer()  # resume from the newest valid checkpoint
        logger.info(
            f"{self.batch.describe()}; seq_len {cfg.training.seq_len}; "
            f"param dtype {self.param_dtype}"
        )

    # ------------------------------------------------------------------ build steps
    def _init_distributed(self) -> None:
        cfg = self.cfg
        ft = cfg.fault_tolerance
        if ft.watchdog_timeout_seconds > 0 and dist_utils.device_type() == "cuda":
            configure_flight_recorder(Path(cfg.job.dump_folder) / ft.watchdog_folder)
        self.device, world_size, self.rank = dist_utils.init_distributed(
            cfg.comm.init_timeout_seconds
        )
        self.parallel_dims = dims = ParallelDims.from_config(cfg.parallelism, world_size)
        dims.build_mesh(self.device.type)
        self.pp_plan = pipeline_plan(cfg)
        self.pp_stage_ids = self.pp_plan.stage_ids(dims.coordinates()["pp"]) if self.pp_plan else []
        init_logger(prefix=f"[{dims.describe_rank(self.rank)}{self._stages_text()}] ")
        logger.info(f"{cfg.job.description}: world size {world_size}, device {self.device}, {dims}")
        if cfg.job.print_config:
            logger.info("resolved config:\n" + to_toml(cfg))
        dist_utils.set_determinism(cfg.debug.seed, cfg.debug.deterministic)

    def _build_data(self) -> None:
        t = self.cfg.training
        self.tokenizer = build_tokenizer(self.cfg.model.tokenizer_path)
        self.dataloader = build_rank_dataloader(
            self.cfg, self.parallel_dims, self.tokenizer, t.dataset, t.dataset_path, "train", True
        )
        self.batch = self.parallel_dims.batch_plan(t.local_batch_size, t.global_batch_size)
        self.grad_accum_steps = self.batch.grad_accum_steps
        # Tokens per step that count for this device: a rank's data-parallel share, divided
        # among the ranks that split the same tokens (TP, CP, PP).
        self.tokens_per_step = t.local_batch_size * t.seq_len * self.grad_accum_steps
        self.device_tokens_per_step = (
            self.tokens_per_step // self.parallel_dims.non_data_parallel_size
        )
        self.global_tokens_per_step = self.batch.global_batch_size * t.seq_len

    def _build_model(self) -> None:
        cfg, dims = self.cfg, self.parallel_dims
        self.spec = MODELS[cfg.model.name]
        backend = resolve_attn_backend(cfg.model.attn_backend, self.device.type, dims.cp_enabled)
        self.model_args = runtime_args(
            self.spec, cfg.model.flavor, self.tokenizer.vocab_size, cfg.training.seq_len, backend
        )
        self.model_args = moe_overrides(self.model_args, cfg.model)  # model.moe_* (docs/moe.md)
        model = build_meta_model(cfg, self.spec, self.model_args, dims, self.device)
        self.loss_fn = self._build_loss_fn()
        self.param_dtype = dist_utils.resolve_dtype(
            cfg.training.mixed_precision_param, self.device.type
        )
        if cfg.optimizer.master_weights_dtype == "bfloat16":  # docs/memory.md
            model.to(torch.bfloat16)
            self.param_dtype = torch.bfloat16
        reduce_dtype = dist_utils.resolve_dtype(
            cfg.training.mixed_precision_reduce, self.device.type
        )
        self.model_parts: list[nn.Module] = build_model_parts(
            cfg,
            self.spec,
            self.model_args,
            model,
            dims,
            self.pp_plan,
            (self.param_dtype, reduce_dtype),
            self.device,
        )
        self.model = self.model_parts[0]
        if cfg.training.loss_chunk_size > 0:  # the model returns hidden states (docs/memory.md)
            self.loss_fn = build_chunked_loss(
                self.model_parts,
                self.spec.parallel_plan(self.model_args).tensor_parallel.output,
                cfg.training.loss_chunk_size,
                gather_logits=dims.tp_enabled and cfg.parallelism.disable_loss_parallel,
                reduction="sum",  # scaled by the step's loss_scale, like cross_entropy_sum
            )
        self.pipeline = self._build_pipeline()
        self.cp = self._build_context_parallel()
        # MoE: the auxiliary loss is seeded in the backward with the loss's scale (docs/moe.md).
        n_mb = self.pp_plan.n_microbatches if self.pp_plan is not None else 1
        set_aux_loss_scale(self.model_parts, 1.0 / (n_mb * self.grad_accum_steps))

    def _build_loss_fn(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """Summed token cross-entropy, compiled (lazily, at its first call) when compile lists
        the loss; the step's ``loss_scale`` makes it the global-batch mean (docs/sft.md)."""
        cfg = self.cfg
        # Set by train_step before each step's forwards: a device scalar, no host sync.
        self.loss_scale: torch.Tensor | float = 1.0
        if not cfg.compile.enable:
            return cross_entropy_sum
        # Ranks at different TP/CP coordinates compile different graphs: separate caches.
        dims, coords = self.parallel_dims, self.parallel_dims.coordinates()
        cache = set_compile_cache_dir(
            cfg.compile.cache_dir,
            base_folder=cfg.job.dump_folder,
            rank_subdir=f"tp{coords['tp']}_cp{coords['cp']}"
            if dims.tp_enabled or dims.cp_enabled
            else None,
        )
        logger.info(f"compile cache: {cache}")
        if "loss" in cfg.compile.components:
            return compile_loss(cross_entropy_sum, backend=cfg.compile.backend)
        return cross_entropy_sum

    def _build_pipeline(self) -> Pipeline | None:
        if self.pp_plan is None:
            return None
        dims = self.parallel_dims
        pipeline = build_pipeline(
            self.model_parts,
            self.pp_plan,
            pp_rank=dims.coordinates()["pp"],
            pp_group=dims.get_mesh("pp").get_group(),
            device=self.device,
            loss_fn=self.pipeline_loss,
            get_mesh=lambda names: (
                dims.get_mesh(names[0]) if len(names) == 1 else dims.world_mesh[names]
            ),
        )
        n_mb = self.pp_plan.n_microbatches
        mb = self.cfg.training.local_batch_size // n_mb
        logger.info(
            f"pipeline {self.pp_plan.schedule}: {self.pp_plan.num_stages} stages, {n_mb} "
            f"microbatches of {mb} sequence{'s' if mb > 1 else ''}; {self.pp_plan.describe()}"
        )
        return pipeline

    def _build_context_parallel(self) -> ContextParallel | None:
        """Under CP each rank trains on its load-balanced share of every sequence."""
        if not self.parallel_dims.cp_enabled:
            return None
        p = self.cfg.parallelism
        plan = self.spec.parallel_plan(self.model_args).context_parallel
        return ContextParallel(
            self.parallel_dims.get_mesh("cp"),
            p.context_parallel_method,
            self.model_parts,
            rotate_method=p.context_parallel_rotate_method,
            rope_buffer=plan.rope_buffer if plan else None,
        )

    def _build_optimizer(self) -> None:
        o, s, t = self.cfg.optimizer, self.cfg.lr_scheduler, self.cfg.training
        self.optimizer = build_optimizer(
            self.model_parts,
            o.name,
            o.lr,
            (o.beta1, o.beta2),
            o.eps,
            o.weight_decay,
            o.implementation,
            moments_dtype=o.moments_dtype,
            seed=self.cfg.debug.seed,
        )
        self.lr_scheduler = build_lr_scheduler(
            self.optimizer,
            total_steps=t.steps,
            warmup_steps=s.warmup_steps,
            warmup_start_factor=s.warmup_start_factor,
            decay_ratio=s.decay_ratio,
            decay_type=s.decay_type,
            min_lr_factor=s.min_lr_factor,
        )
        f8 = self.cfg.quantize.dense.float8
        if (
            f8.enable
            and f8.precompute_float8_dynamic_scale_for_fsdp
            and self.parallel_dims.fsdp_enabled
        ):
            register_float8_precompute_hook(self.optimizer, self.model_parts)

    def _build_observability(self) -> None:
        """Metrics (MFU against a known or measured peak), the non-finite guard, validation
        and the profiler (docs/observability.md)."""
        cfg = self.cfg
        peak = peak_flops(self.device, self.param_dtype)
        logger.info(f"peak {self.param_dtype} FLOP/s for MFU: {peak[0] / 1e12:.3f} T ({peak[1]})")
        flops = self.spec.flops_per_token(self.model_args, cfg.training.seq_len)
        self.metrics, writers = build_metrics(
            cfg, self.parallel_dims, self.pp_plan, self.device, self.rank, flops, peak
        )
        mixture_tokens = getattr(self.dataloader.dataset, "metrics_fields", None)
        if mixture_tokens is not None:  # tokens each mixture source has given (docs/data.md)
            self.metrics.extra_fields.append(lambda: (mixture_tokens(), ""))
        moe_load = ExpertLoadMetrics(self.model_parts, self.parallel_dims.get_mesh("dp_cp"))
        if moe_load:  # per-layer expert load and aux loss at log steps (docs/moe.md)
            self.metrics.extra_fields.append(moe_load)
        self.nonfinite = NonFiniteGuard(
            cfg.training.nonfinite_policy, rank=self.rank, stage_ids=self.pp_stage_ids or None
        )
        self.validator = self._build_validator(writers) if cfg.validation.enable else None
        self.profiling = build_profiling(cfg, self.rank, self.device)
        self._build_fault_tolerance()

    def _build_fault_tolerance(self) -> None:
        """Spike policy and skip limit, hang watchdog, test-only fault injection
        (docs/observability.md)."""
        t, ft = self.cfg.training, self.cfg.fault_tolerance
        self.step_guard = StepGuard(
            t.spike_policy,
            window=t.spike_window,
            threshold=t.spike_threshold,
            warmup=t.spike_warmup,
            max_consecutive_skips=t.max_consecutive_skips,
            rank=self.rank,
        )
        self.rollback_pending = False
        self.microbatches_drawn = 0  # position in this rank's data stream, for spike reports
        self.watchdog = (
            Watchdog(
                ft.watchdog_timeout_seconds,
                Path(self.cfg.job.dump_folder) / ft.watchdog_folder,
                self.rank,
            )
            if ft.watchdog_timeout_seconds > 0
            else None
        )
        self.faults = parse_faults(self.rank)

    def _build_validator(self, writers: list[MetricWriter]) -> Validator:
        v, dims = self.cfg.validation, self.parallel_dims
        loader = build_rank_dataloader(
            self.cfg, dims, self.tokenizer, v.dataset, v.dataset_path, "validation", False
        )
        return Validator(
            dataloader=loader,
            freq=v.freq,
            steps=v.steps,
            loss_fn=self.validation_loss,
            batch_size=self.cfg.training.local_batch_size,
            model_parts=self.model_parts,
            device=self.device,
            writers=writers,
            dp_mesh=dims.get_mesh("dp"),
            loss_mesh=dims.get_mesh("dp_cp"),
            pp_mesh=dims.get_mesh("pp") if dims.pp_enabled else None,
        )

    def _build_checkpointer(self) -> None:
        self.step = 0
        self.data_iter: Iterator | None = None
        self.checkpointer: CheckpointManager | None = None
        if not self.cfg.checkpoint.enable:
            return
        self.checkpointer = build_checkpointer(
            self.cfg,
            self.spec,
            self.model_args,
            self.model_parts,
            self.optimizer,
            self.lr_scheduler,
            self.dataloader,
        )
        resumed = self.checkpointer.load()
        if resumed is not None:
            self.step = resumed["step"]
            self.microbatches_drawn = self.step * self.grad_accum_steps

    # ------------------------------------------------------------------ one step
    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor, ModelInputs]:
        """The next microbatch on the device: inputs, labels and the model's extra inputs
        (document ids and positions under block_causal, see ``model_inputs``)."""
        start = time.perf_counter()
        self.faults.before_batch()
        if self.data_iter is None:
            self.data_iter = iter(self.dataloader)
        batch = next(self.data_iter)
        self.microbatches_drawn += 1
        self.metrics.add_data_time(time.perf_counter() - start)
        inputs, labels, *rest = (t.to(self.device, non_blocking=True) for t in batch)
        return inputs, labels, self.model_inputs(rest[0] if rest else None)

    def model_inputs(self, doc_ids: torch.Tensor | None) -> ModelInputs:
        """Keyword inputs of the model's forward for a batch: none under causal masking;
        ``doc_ids`` under block_causal, and per-document RoPE ``positions`` with
        ``training.document_positions`` (computed on the whole sequence, before CP shards it)."""
        if doc_ids is None:
            return {}
        extra = {"doc_ids": doc_ids}
        if self.cfg.training.document_positions:
            extra["positions"] = document_positions(doc_ids)
        return extra

    def validation_loss(
        self, inputs: torch.Tensor, labels: torch.Tensor, doc_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, int] | None:
        """Summed token loss and token count of one validation batch, forward only (the
        Validator's hook). Under PP only the last stage has a loss: ``None`` elsewhere."""
        extra = self.model_inputs(doc_ids)
        self.loss_scale = 1.0  # plain sums (the next train_step sets its own scale)
        with self.train_context(), self.sequence_share(inputs, labels, extra) as share:
            inputs, labels, extra = share
            n = int(unmasked_tokens([labels], None))  # this rank's tokens (its share under CP)
            if self.pipeline is not None:
                # Forward-only run of the same schedule: the sum of the microbatches' sums.
                summed = self.pipeline.eval(inputs, labels, **extra)
                if summed is None:
                    return None
                return dist_utils.local_tensor(summed), n
            loss = self.loss_fn(self.model(inputs, **extra), labels)
        return dist_utils.local_tensor(loss.detach()), n

    def sequence_share(
        self, inputs: torch.Tensor, labels: torch.Tensor, extra: ModelInputs
    ) -> contextlib.AbstractContextManager[tuple[torch.Tensor, torch.Tensor, ModelInputs]]:
        """A context around forward (and backward) yielding the inputs, labels and extra model
        inputs this rank computes on: the whole batch, or under context parallel its share of
        every sequence."""
        if self.cp is None:
            return contextlib.nullcontext((inputs, labels, extra))
        return self.cp.batch(inputs, labels, extra)

    def train_context(self) -> contextlib.ExitStack:
        """Contexts around forward, loss and backward: autocast where no FSDP/DDP policy casts
        parameters; loss parallel under TP (cross-entropy on vocabulary-sharded logits, whose
        backward must run inside the context too)."""
        stack = contextlib.ExitStack()
        dims = self.parallel_dims
        if self.param_dtype != torch.float32 and not (dims.fsdp_enabled or dims.ddp_enabled):
            stack.enter_context(torch.autocast(self.device.type, dtype=self.param_dtype))
        if dims.tp_enabled and not self.cfg.parallelism.disable_loss_parallel:
            stack.enter_context(loss_parallel())
        return stack

    def _stages_text(self) -> str:
        """Log-prefix suffix naming this rank's pipeline stages, e.g. `` stages=1,3(last)``."""
        if self.pp_plan is None:
            return ""
        last = self.pp_plan.num_stages - 1 in self.pp_stage_ids
        return f" stages={','.join(map(str, self.pp_stage_ids))}" + ("(last)" if last else "")

    def pipeline_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Loss of one pipeline microbatch, scaled so the gradients sum to the global-batch mean."""
        assert self.pp_plan is not None
        return self.loss_fn(logits, labels) * self.loss_scale

    def forward_backward(
        self, inputs: torch.Tensor, labels: torch.Tensor, extra: ModelInputs | None = None
    ) -> torch.Tensor:
        """Forward, loss and backward of one microbatch; returns the detached, scaled loss."""
        extra = extra or {}
        if self.pipeline is not None:
            with self.train_context(), self.sequence_share(inputs, labels, extra) as share:
                inputs, labels, extra = share
                # torch splits the tensors in ``extra`` into microbatches and gives every
                # stage its microbatch's share (docs/attention.md).
                loss = self.pipeline.step(inputs, labels, **extra)
            # Only the last stage has a loss. Elsewhere this zero stays in the rank's running sum
            # and is never shown: at log steps the metrics take the last stage's values.
            if loss is None:
                return torch.zeros((), device=self.device)
            return dist_utils.local_tensor(loss)
        with self.train_context(), self.sequence_share(inputs, labels, extra) as share:
            inputs, labels, extra = share
            logits = self.model(inputs, **extra)
            # Scale so the accumulated gradient is the mean over the whole global batch.
            loss = self.loss_fn(logits, labels) * self.loss_scale
            loss = loss * self.faults.loss_factor(self.step)  # 1.0 unless a test injects a spike
            del logits
            loss.backward()
        # Under loss parallel the loss is a replicated DTensor: keep its (full) local value.
        return dist_utils.local_tensor(loss.detach())

    def step_loss_scale(self, labels: list[torch.Tensor]) -> torch.Tensor:
        """Global token normalisation (docs/sft.md): the ranks averaging gradients and logged
        losses (data x context parallel) over the unmasked tokens of the global batch (these
        microbatches, whole sequences, summed over the data-parallel ranks)."""
        dims = self.parallel_dims
        tokens = unmasked_tokens(labels, dims.get_mesh("dp") if dims.dp_degree > 1 else None)
        return global_loss_scale(tokens, dims.get_mesh("dp_cp").size())

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over ``grad_accum_steps`` microbatches; returns (loss, grad norm)."""
        self.optimizer.zero_grad(set_to_none=True)
        step_loss = torch.zeros((), device=self.device)
        for _ in range(self.step_guard.batches_to_skip(self.step)):
            self.next_batch()  # the batches of this step that spiked before a rollback
        batches = [self.next_batch() for _ in range(self.grad_accum_steps)]
        self.loss_scale = self.step_loss_scale([labels for _, labels, _ in batches])
        for inputs, labels, extra in batches:
            step_loss += self.forward_backward(inputs, labels, extra)
        params = [p for part in self.model_parts for p in part.parameters()]
        # Measure the norm (max_norm 0), check it, then clip: clipping by a NaN norm would make
        # every gradient NaN and hide the parameter where the NaN appeared.
        grad_norm = dist_utils.clip_grad_norm_(
            params,
            0.0,
            pp_mesh=self.parallel_dims.get_mesh("pp") if self.parallel_dims.pp_enabled else None,
        )
        # A NaN/inf loss or norm raises, or (skip_step) keeps the weights and optimizer state.
        if not self.nonfinite.check(self.step, step_loss, grad_norm, self.model_parts):
            self.metrics.skipped_steps = self.nonfinite.skipped_steps
            self.step_guard.skipped(self.step, "non-finite values", self.model_parts)
        else:
            # A loss spike warns, skips the step, or asks train() for a rollback.
            verdict = self.step_guard.check(
                self.step, self.nonfinite.last_loss, self._batch_position()
            )
            if verdict == "step":
                if self.cfg.training.max_norm > 0:
                    dist_utils.clip_grads_with_norm_(params, self.cfg.training.max_norm, grad_norm)
                self.optimizer.step()
                update_expert_bias(self.model_parts, self.parallel_dims.get_mesh("dp_cp"))  # MoE
                self.step_guard.stepped()
            elif verdict == "skip":
                self.step_guard.skipped(self.step, "loss spike", self.model_parts)
            else:
                self.rollback_pending = True
        self.lr_scheduler.step()
        return step_loss, grad_norm

    def _batch_position(self) -> str:
        a, n = self.grad_accum_steps, self.microbatches_drawn
        dp = self.parallel_dims.get_mesh("dp").get_local_rank()
        return f"microbatches {n - a}..{n - 1} of data-parallel rank {dp}'s stream"

    def _rollback(self) -> bool:
        """Reload the newest checkpoint before this step after a loss spike; False (the step
        then counts as skipped) when there is none yet."""
        self.rollback_pending = False
        bad = self.step
        resumed = self.checkpointer.rollback(before=bad) if self.checkpointer else None
        if resumed is None:
            logger.warning(f"loss spike at step {bad}: no checkpoint to roll back to; skipped")
            self.step_guard.skipped(bad, "loss spike, no checkpoint yet", self.model_parts)
            return False
        self.step, self.data_iter = resumed["step"], None
        self.step_guard.rolled_back(bad, self.step, self.grad_accum_steps)
        self.microbatches_drawn = self.step * self.grad_accum_steps
        logger.warning(f"rolled back to step {self.step}; step {bad}'s batches will be skipped")
        return True

    def train(self) -> None:
        cfg = self.cfg
        gc_freq = cfg.training.gc_freq
        if gc_freq > 0:
            gc.disable()
        logger.info(f"training for {cfg.training.steps} steps")
        self.metrics.start_timer(self.step)
        self.profiling.start(self.step)
        while self.step < cfg.training.steps:
            self.step += 1
            if gc_freq > 0 and self.step % gc_freq == 0:
                gc.collect(1)
            if self.watchdog is not None and self.step > 1:
                self.watchdog.beat(self.step, "training step (forward, backward, collectives)")
            self.faults.at_step_start(self.step)  # test-only (tools/fault_injection.py)
            lr = self.optimizer.param_groups[0]["lr"]
            loss, grad_norm = self.train_step()
            if self.rollback_pending and self._rollback():
                continue
            self.metrics.end_step(loss, grad_norm, self.device_tokens_per_step, step=self.step)
            if self.metrics.should_log(self.step):
                self._phase("metrics log (cross-rank all-reduce)")
                self.metrics.log(self.step, lr)
            if self.validator is not None and self.validator.should_validate(self.step):
                self._phase("validation")
                start = time.perf_counter()
                self.validator.validate(self.step)
                self.metrics.exclude_time(time.perf_counter() - start)
            self.profiling.step(self.step)
            if self.checkpointer is not None:
                self._phase("checkpoint (save, commit, preemption agreement)")
                start = time.perf_counter()
                stop = self.checkpointer.step_end(
                    self.step, self.step * self.global_tokens_per_step
                )
                self.metrics.exclude_time(time.perf_counter() - start)
                if stop:
                    self.preempted_at = self.step
                    logger.info(f"stopping after step {self.step} (preemption signal)")
                    break
            if self.step == 1:
                dist_utils.set_pg_timeouts(
                    cfg.comm.train_timeout_seconds, self.parallel_dims.world_mesh
                )
        if self.watchdog is not None:
            self.watchdog.pause()
        logger.info("training done")

    def _phase(self, phase: str) -> None:
        if self.watchdog is not None:
            self.watchdog.phase(phase)

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.close()
        if self.checkpointer is not None:
            self.checkpointer.close()
        self.profiling.stop()
        self.metrics.close()
        gc.enable()
