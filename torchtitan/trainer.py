"""The Trainer: builds everything in the order of docs/architecture.md (section 3), then runs
the loop.

Read top-down: ``__init__`` is the build order (one named step each; the builders themselves
are in ``torchtitan/builders.py``), ``train`` is the loop with metrics at ``log_freq``. One
optimizer step with gradient accumulation (``train_step`` and what it calls) is in
``torchtitan/train_step.py``.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path

import torch
from torch import nn

from torchtitan.builders import (
    build_checkpointer,
    build_evaluator,
    build_loss_fn,
    build_meta_model,
    build_metrics,
    build_model_parts,
    build_profiling,
    build_rank_dataloader,
    build_validator,
    init_model_weights,
    peak_flops,
)
from torchtitan.checkpoint.manager import CheckpointManager
from torchtitan.config.job_config import JobConfig
from torchtitan.config.manager import to_toml
from torchtitan.data.tokenizer import build_tokenizer
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.context_parallel import ContextParallel
from torchtitan.distributed.float8 import register_float8_precompute_hook
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.pipeline_parallel import Pipeline, build_pipeline
from torchtitan.fault_tolerance.replica import ReplicaGroup
from torchtitan.guards.nonfinite import NonFiniteGuard
from torchtitan.guards.spikes import StepGuard
from torchtitan.lora.qlora import quantize_base
from torchtitan.loss.chunked import build_chunked_loss
from torchtitan.microbatch import MicrobatchRunner, ScaledLoss
from torchtitan.models import MODELS, model_title, run_args
from torchtitan.models.common.attention import resolve_attn_backend
from torchtitan.models.common.moe import set_aux_loss_scale
from torchtitan.models.common.moe_metrics import ExpertLoadMetrics
from torchtitan.optim.lr_scheduler import build_lr_scheduler
from torchtitan.optim.optimizer import build_optimizer
from torchtitan.plan.auto import check_same_layout
from torchtitan.plan.lora_memory import training_flops_per_token
from torchtitan.preflight.validate import pipeline_plan
from torchtitan.tools import startup
from torchtitan.tools.fault_injection import parse_faults
from torchtitan.tools.logging import init_logger, logger
from torchtitan.tools.watchdog import Watchdog, configure_flight_recorder
from torchtitan.train_step import TrainStep


class Trainer:
    preempted_at: int | None = None  # the step after which a preemption signal stopped train()

    def __init__(self, cfg: JobConfig) -> None:
        """Build in order; the config was validated before we got here."""
        self.cfg = cfg
        self._init_distributed()  # process group, mesh, pipeline plan, log prefix, seeds
        startup.mark("process group")
        self._build_data()  # tokenizer, data loader, batch plan
        startup.mark("data")
        self._build_model()  # meta model, converters, parallelisms, weights, pipeline, CP
        self._build_optimizer()  # optimizer and LR schedule
        self._build_observability()  # metrics, non-finite guard, validation, profiler
        startup.mark("optimizer, metrics")
        self._build_checkpointer()  # resume from the newest valid checkpoint
        self._quantize_base()  # QLoRA: the final frozen base to NF4 (docs/lora.md)
        self._build_step()  # one training step, given every collaborator it uses
        # torchft replica groups (docs/fault_tolerance.md): quorum, cross-group gradients
        self.replicas = ReplicaGroup.for_trainer(self) if cfg.fault_tolerance.enable else None
        self.steps.replicas = self.replicas
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
        if cfg.parallelism.auto:  # every rank must have chosen the same layout
            check_same_layout(cfg)
        self.parallel_dims = dims = ParallelDims.from_config(cfg.parallelism, world_size)
        dims.build_mesh(self.device.type)
        self.pp_plan = pipeline_plan(cfg)
        self.pp_stage_ids = self.pp_plan.stage_ids(dims.coordinates()["pp"]) if self.pp_plan else []
        init_logger(prefix=f"[{dims.describe_rank(self.rank)}{self._stages_text()}] ")
        logger.info(
            f"{model_title(cfg)} (job {cfg.job.description!r}): world size {world_size}, "
            f"device {self.device}, {dims}"
        )
        if cfg.job.print_config:
            logger.info("resolved config:\n" + to_toml(cfg))
        dist_utils.set_determinism(cfg.debug.seed, cfg.debug.deterministic)

    def _stages_text(self) -> str:
        """Log-prefix suffix naming this rank's pipeline stages, e.g. `` stages=1,3(last)``."""
        if self.pp_plan is None:
            return ""
        last = self.pp_plan.num_stages - 1 in self.pp_stage_ids
        return f" stages={','.join(map(str, self.pp_stage_ids))}" + ("(last)" if last else "")

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
        # the flavor, an HF folder's RoPE/window settings, model.moe_* and model.mtp_*
        self.model_args = run_args(cfg, self.tokenizer.vocab_size, backend)
        model = build_meta_model(cfg, self.spec, self.model_args, dims, self.device)
        loss_fn = build_loss_fn(cfg, dims)
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
            loss_fn = build_chunked_loss(
                self.model_parts,
                self.spec.parallel_plan(self.model_args).tensor_parallel.output,
                cfg.training.loss_chunk_size,
                gather_logits=dims.tp_enabled and cfg.parallelism.disable_loss_parallel,
                reduction="sum",  # scaled by the step's loss_scale, like cross_entropy_sum
            )
        # The step sets its global-token scale before its forwards (docs/sft.md).
        self.loss = ScaledLoss(loss_fn)
        self.pipeline = self._build_pipeline()
        self.cp = self._build_context_parallel()
        self.runner = MicrobatchRunner(
            self.model_parts,
            self.loss,
            self.pipeline,
            self.cp,
            dims,
            self.device,
            self.param_dtype,
            loss_parallel=dims.tp_enabled and not cfg.parallelism.disable_loss_parallel,
            document_positions=cfg.training.document_positions,
        )
        # MoE: the auxiliary loss is seeded in the backward with the loss's scale (docs/moe.md).
        n_mb = self.pp_plan.n_microbatches if self.pp_plan is not None else 1
        set_aux_loss_scale(self.model_parts, 1.0 / (n_mb * self.grad_accum_steps))

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
            loss_fn=self.loss,
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
            balancer=p.context_parallel_load_balancer,
        )

    def _build_optimizer(self) -> None:
        o, s, t = self.cfg.optimizer, self.cfg.lr_scheduler, self.cfg.training
        plan = self.spec.parallel_plan(self.model_args)
        self.optimizer = build_optimizer(
            self.model_parts,
            o,
            seed=self.cfg.debug.seed,
            device_type=self.device.type,
            output=plan.tensor_parallel.output,
            embedding=plan.embedding,
            strict=not self.parallel_dims.pp_enabled,  # a stage may hold none of a rule's
        )
        self.lr_scheduler = build_lr_scheduler(self.optimizer, s, total_steps=t.steps)
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
        flops = training_flops_per_token(cfg, self.model_args)  # a frozen base counted as such
        self.metrics, writers = build_metrics(
            cfg, self.parallel_dims, self.pp_plan, self.device, self.rank, flops, peak
        )
        mixture_tokens = getattr(self.dataloader.dataset, "metrics_fields", None)
        if mixture_tokens is not None:  # tokens each mixture source has given (docs/data.md)
            self.metrics.extra_fields.append(lambda: (mixture_tokens(), ""))
        moe_load = ExpertLoadMetrics(self.model_parts, self.parallel_dims.get_mesh("dp_cp"))
        if moe_load:  # per-layer expert load and aux loss at log steps (docs/moe.md)
            self.metrics.extra_fields.append(moe_load)
        # A family's own sources (DeepSeek-V3's MTP loss), once per rank over its local parts;
        # under PP the values of the last stage's pp rank (metrics.pp_loss_rank) reach every rank.
        sources = getattr(self.model_parts[0], "metrics_sources", None)
        if sources is not None:
            pp = (self.metrics.pp_mesh, self.metrics.pp_loss_rank) if self.metrics.pp_mesh else None
            dp_cp = self.parallel_dims.get_mesh("dp_cp")
            self.metrics.extra_fields.extend(sources(self.model_parts, dp_cp, pp))
        self.nonfinite = NonFiniteGuard(
            cfg.training.nonfinite_policy, rank=self.rank, stage_ids=self.pp_stage_ids or None
        )
        self.validator = (
            build_validator(
                cfg,
                self.parallel_dims,
                self.tokenizer,
                self.model_parts,
                self.device,
                writers,
                self.runner.validation_loss,
            )
            if cfg.validation.enable
            else None
        )
        self.evaluator = (  # lm-eval tasks every eval.freq steps (docs/evaluation.md)
            build_evaluator(cfg, self.tokenizer, self.model_parts, self.device, writers)
            if cfg.eval.freq > 0
            else None
        )
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

    def _build_checkpointer(self) -> None:
        self.step = 0
        self.checkpointer: CheckpointManager | None = None
        if not self.cfg.checkpoint.enable:
            if self.cfg.checkpoint.initial_load_path:  # honoured; nothing is saved
                self._load_initial_only()
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
        self.checkpointer.faults = self.faults  # test-only (tools/fault_injection.py)
        resumed = self.checkpointer.load()
        startup.mark("checkpoint load")
        if resumed is not None:
            self.step = resumed["step"]
        if not self.checkpointer.model_loaded:  # initialised only when nothing was loaded
            init_model_weights(self.cfg, self.model_parts, self.device)

    def _load_initial_only(self) -> None:
        """checkpoint.initial_load_path with checkpointing off: the weights (the model was
        initialised already: defers_init is off) are replaced by the folder's."""
        loader = build_checkpointer(
            self.cfg,
            self.spec,
            self.model_args,
            self.model_parts,
            self.optimizer,
            self.lr_scheduler,
            self.dataloader,
        )
        try:
            resumed = loader.load_initial()
        finally:
            loader.close()
        if resumed is not None:
            self.step = resumed["step"]
        logger.info(
            f"checkpoint: the run starts from the weights of {self.cfg.checkpoint.initial_load_path}"
            " (checkpoint.enable is off: no checkpoint will be saved)"
        )
        startup.mark("checkpoint load")

    def _quantize_base(self) -> None:
        if self.cfg.lora.enable and self.cfg.lora.quantize_base == "nf4":
            before, after = quantize_base(self.model_parts)
            logger.info(
                f"qlora: adapted base weights {before / 2**20:.1f} -> {after / 2**20:.1f} MiB (NF4)"
            )

    def _build_step(self) -> None:
        self.steps = TrainStep(
            self.runner,
            self.optimizer,
            self.lr_scheduler,
            self.dataloader,
            self.metrics,
            self.nonfinite,
            self.step_guard,
            self.faults,
            self.checkpointer,
            self.grad_accum_steps,
            max_norm=self.cfg.training.max_norm,
            microbatches_drawn=self.step * self.grad_accum_steps,
        )

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Step ``self.step``: its (loss, grad norm) as device scalars."""
        return self.steps.run(self.step)

    # ------------------------------------------------------------------ the loop
    def train(self) -> None:
        cfg = self.cfg
        gc_freq = cfg.training.gc_freq
        if gc_freq > 0:
            gc.disable()
        logger.info(f"training for {cfg.training.steps} steps")
        self.metrics.start_timer(self.step)
        self.profiling.start(self.step)
        while self.step < cfg.training.steps:
            if self.replicas is not None:  # the last committed step; a recovering group's peer's
                self.step = self.replicas.start_step(self.step)
            self.step += 1
            if gc_freq > 0 and self.step % gc_freq == 0:
                gc.collect(1)
            if self.watchdog is not None and self.step > 1:
                self.watchdog.beat(self.step, "training step (forward, backward, collectives)")
            self.faults.at_step_start(self.step)  # test-only (tools/fault_injection.py)
            group = self.optimizer.param_groups[0]  # the schedule's lr (x1, docs/optimizers.md)
            lr = group["lr"] / group.get("lr_mult", 1.0)
            loss, grad_norm = self.train_step()
            if self.replicas is not None and not self.replicas.committed:
                continue  # torchft discarded the step: start_step runs it again
            if self.steps.rollback_pending:
                resumed = self.steps.rollback(self.step)
                if resumed is not None:
                    self.step = resumed
                    continue
            self.metrics.end_step(loss, grad_norm, self.device_tokens_per_step, step=self.step)
            if self.metrics.should_log(self.step):
                self._phase("metrics log (cross-rank all-reduce)")
                self.metrics.log(self.step, lr)
            if (first := startup.first_step()) is not None:  # docs/performance.md
                logger.info(first)
            if self.validator is not None and self.validator.should_validate(self.step):
                self._phase("validation")
                start = time.perf_counter()
                self.validator.validate(self.step)
                self.metrics.exclude_time(time.perf_counter() - start)
            if self.evaluator is not None and self.evaluator.should_evaluate(self.step):
                self._phase("evaluation (lm-eval tasks)")
                start = time.perf_counter()
                self.evaluator.evaluate(self.step)
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
        if self.replicas is not None:
            self.replicas.close()
        try:  # committing a background save may fail (a full disk): close the rest anyway
            if self.checkpointer is not None:
                self.checkpointer.close()
        finally:
            self.profiling.stop()
            self.metrics.close()
            gc.enable()
