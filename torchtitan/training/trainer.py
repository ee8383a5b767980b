"""The Trainer: builds everything in the order of docs/architecture.md (section 3), then runs
the loop.

Read top-down: ``__init__`` is the build order (one named step each; each piece is built beside
its component, the model in ``torchtitan/training/builders.py``), ``train`` is the loop: the
step, its metrics, and the hooks of the optional features (``torchtitan/training/hooks/``). One
optimizer step with gradient accumulation (``train_step`` and what it calls) is in
``torchtitan/training/train_step.py``.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchtitan.checkpoint.from_config import build_checkpointer
from torchtitan.checkpoint.manager import CheckpointManager
from torchtitan.checkpoint.safety import resume_settings
from torchtitan.config.job_config import JobConfig
from torchtitan.config.manager import to_toml
from torchtitan.data.dataloader import ParallelAwareDataloader
from torchtitan.data.rank_loader import rank_dataloader, uses_images
from torchtitan.data.tokenizer import build_tokenizer
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.context_parallel import ContextParallel
from torchtitan.distributed.float8 import register_float8_precompute_hook
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.pipeline_parallel import Pipeline, build_pipeline
from torchtitan.eval.harness import training_evaluator
from torchtitan.eval.validation_loss import build_validator
from torchtitan.fault_tolerance.outer_state import checkpoint_parts
from torchtitan.fault_tolerance.replica import ReplicaGroup, data_shard
from torchtitan.guards.nonfinite import NonFiniteGuard
from torchtitan.guards.spikes import StepGuard
from torchtitan.lora.qlora import quantize_base
from torchtitan.loss.chunked import build_chunked_loss
from torchtitan.loss.cross_entropy import build_loss_fn
from torchtitan.metrics.processor import build_metrics
from torchtitan.metrics.writers import build_job_writers
from torchtitan.models import MODELS, model_title, run_args
from torchtitan.models.common.attention import resolve_attn_backend
from torchtitan.optim.lr_scheduler import build_lr_scheduler
from torchtitan.optim.optimizer import build_optimizer
from torchtitan.planner.auto import check_same_layout
from torchtitan.planner.lora_memory import training_flops_per_token
from torchtitan.preflight.validate import pipeline_stages
from torchtitan.tools import startup
from torchtitan.tools.fault_injection import parse_faults
from torchtitan.tools.logging import init_logger, logger
from torchtitan.tools.peak_flops import mfu_peak_flops
from torchtitan.tools.profiling import Profiling
from torchtitan.tools.watchdog import Watchdog, configure_flight_recorder
from torchtitan.training.builders import build_meta_model, build_model_parts, init_model_weights
from torchtitan.training.hooks.base import Closing, OffStepTime, StepHook, close_all
from torchtitan.training.hooks.build import build_hooks
from torchtitan.training.microbatch import MicrobatchRunner, ScaledLoss
from torchtitan.training.train_step import TrainStep


class Trainer:
    preempted_at: int | None = None  # the step after which a preemption signal stopped train()

    def __init__(self, cfg: JobConfig) -> None:
        """Build in order; the config was validated before we got here."""
        self.cfg = cfg
        self._init_distributed()  # process group, mesh, pipeline stages, log prefix, seeds
        startup.mark("process group")
        self._build_data()  # tokenizer, data loader, batch sizes
        startup.mark("data")
        self._build_model()  # meta model, converters, parallelisms, weights, pipeline, CP
        self._build_optimizer()  # optimizer and LR schedule
        self._build_observability()  # metrics, non-finite guard, validation, profiler
        startup.mark("optimizer, metrics")
        self._build_checkpointer()  # resume from the newest valid checkpoint
        self._quantize_base()  # QLoRA: the final frozen base to NF4 (docs/lora.md)
        self._build_step()  # one training step, given every collaborator it uses
        self.hooks = self._build_hooks()  # gc, watchdog, faults, validation, ..., checkpoint
        # torchft replica groups (docs/fault_tolerance.md): quorum, cross-group gradients
        self.replicas = ReplicaGroup.for_trainer(self) if cfg.fault_tolerance.enable else None
        self.stepper.replicas = self.replicas
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
        self.pp_stages = pipeline_stages(cfg)
        self.pp_stage_ids = (
            self.pp_stages.stage_ids(dims.coordinates()["pp"]) if self.pp_stages else []
        )
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
        if self.pp_stages is None:
            return ""
        last = self.pp_stages.num_stages - 1 in self.pp_stage_ids
        return f" stages={','.join(map(str, self.pp_stage_ids))}" + ("(last)" if last else "")

    def _build_data(self) -> None:
        t = self.cfg.training
        self.tokenizer = build_tokenizer(self.cfg.model.tokenizer_path)
        self.dataloader = self._rank_dataloader(t.dataset, t.dataset_path, "train", True)
        self.batch = self.parallel_dims.batch_sizes(t.local_batch_size, t.global_batch_size)
        self.grad_accum_steps = self.batch.grad_accum_steps
        # Tokens per step that count for this device: a rank's data-parallel share, divided
        # among the ranks that split the same tokens (TP, CP, PP).
        self.tokens_per_step = t.local_batch_size * t.seq_len * self.grad_accum_steps
        self.device_tokens_per_step = (
            self.tokens_per_step // self.parallel_dims.non_data_parallel_size
        )
        self.global_tokens_per_step = self.batch.global_batch_size * t.seq_len

    def _rank_dataloader(
        self, dataset: str, path: str | None, split: str, infinite: bool
    ) -> ParallelAwareDataloader:
        """A loader of ``dataset`` sharded by this rank's data-parallel coordinate only (and,
        for training under fault tolerance, by its replica group: docs/fault_tolerance.md)."""
        cfg, dp = self.cfg, self.parallel_dims.get_mesh("dp")
        # image-text data reads the vision sizes and token ids of the args the run builds
        images = uses_images(cfg.training, dataset)
        return rank_dataloader(
            cfg.training,
            cfg.sft,
            self.tokenizer,
            dp,
            dataset=dataset,
            dataset_path=path,
            split=split,
            infinite=infinite,
            seed=cfg.debug.seed,
            with_doc_ids=cfg.model.attn_mask_type == "block_causal",
            model_args=run_args(cfg, self.tokenizer.vocab_size) if images else None,
            shard=data_shard(cfg.fault_tolerance, dp.get_local_rank(), dp.size())
            if split == "train"
            else None,
        )

    def _build_model(self) -> None:
        cfg, dims = self.cfg, self.parallel_dims
        self.spec = MODELS[cfg.model.name]
        backend = resolve_attn_backend(cfg.model.attn_backend, self.device.type, dims.cp_enabled)
        # the flavor, an HF folder's RoPE/window settings, model.moe_* and model.mtp_*
        # Under CP the all-gather core runs the kernel over the gathered keys (apply_cp gets
        # the backend): the model builds no BlockMask of its local tokens.
        model_backend = "sdpa" if dims.cp_enabled else backend
        self.model_args = run_args(cfg, self.tokenizer.vocab_size, model_backend)
        model = build_meta_model(cfg, self.spec, self.model_args, dims, self.device)
        loss_fn = build_loss_fn(cfg.compile, cfg.job.dump_folder, dims)
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
            self.pp_stages,
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
        # The family's own (MoE: the auxiliary loss's gradient seed, docs/moe.md).
        n_mb = self.pp_stages.n_microbatches if self.pp_stages is not None else 1
        self.spec.hooks.after_build(self.model_parts, n_mb * self.grad_accum_steps)

    def _build_pipeline(self) -> Pipeline | None:
        if self.pp_stages is None:
            return None
        dims = self.parallel_dims
        pipeline = build_pipeline(
            self.model_parts,
            self.pp_stages,
            pp_rank=dims.coordinates()["pp"],
            pp_group=dims.get_mesh("pp").get_group(),
            device=self.device,
            loss_fn=self.loss,
            get_mesh=lambda names: (
                dims.get_mesh(names[0]) if len(names) == 1 else dims.world_mesh[names]
            ),
        )
        n_mb = self.pp_stages.n_microbatches
        mb = self.cfg.training.local_batch_size // n_mb
        logger.info(
            f"pipeline {self.pp_stages.schedule}: {self.pp_stages.num_stages} stages, {n_mb} "
            f"microbatches of {mb} sequence{'s' if mb > 1 else ''}; {self.pp_stages.describe()}"
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
            whole_inputs=plan.whole_inputs if plan else (),
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
        peak = mfu_peak_flops(self.device, self.param_dtype)
        logger.info(f"peak {self.param_dtype} FLOP/s for MFU: {peak[0] / 1e12:.3f} T ({peak[1]})")
        flops = training_flops_per_token(cfg, self.model_args)  # a frozen base counted as such
        m, pp_stages, dims = cfg.metrics, self.pp_stages, self.parallel_dims
        writers = build_job_writers(
            cfg, self.rank, write_this_rank=m.save_for_all_ranks or self.rank == 0
        )
        self.metrics = build_metrics(
            m,
            cfg.fault_tolerance,
            dump_folder=cfg.job.dump_folder,
            total_steps=cfg.training.steps,
            writers=writers,
            device=self.device,
            rank=self.rank,
            loss_mesh=dims.get_mesh("dp_cp"),
            pp=(dims.get_mesh("pp"), pp_stages.last_stage_pp_rank) if pp_stages else None,
            flops_per_token=flops,
            peak=peak,
        )
        mixture_tokens = getattr(self.dataloader.dataset, "metrics_fields", None)
        if mixture_tokens is not None:  # tokens each mixture source has given (docs/data.md)
            self.metrics.extra_fields.append(lambda: (mixture_tokens(), ""))
        # The family's sources (MoE expert load, DeepSeek-V3's MTP loss) over the local parts;
        # under PP the values of the last stage's pp rank (metrics.pp_loss_rank) reach every rank.
        pp = (self.metrics.pp_mesh, self.metrics.pp_loss_rank) if self.metrics.pp_mesh else None
        dp_cp = self.parallel_dims.get_mesh("dp_cp")
        self.metrics.extra_fields.extend(
            self.spec.hooks.metrics_fields(self.model_parts, dp_cp, pp)
        )
        self.nonfinite = NonFiniteGuard(
            cfg.training.nonfinite_policy, rank=self.rank, stage_ids=self.pp_stage_ids or None
        )
        v = cfg.validation
        self.validator = (
            build_validator(
                v,
                self._rank_dataloader(v.dataset, v.dataset_path, "validation", False),
                dims,
                loss_fn=self.runner.validation_loss,
                batch_size=cfg.training.local_batch_size,
                model_parts=self.model_parts,
                device=self.device,
                writers=writers,
            )
            if v.enable
            else None
        )
        self.evaluator = (  # lm-eval tasks every eval.freq steps (docs/evaluation.md)
            training_evaluator(
                cfg.eval,
                self.model_parts,
                self.tokenizer,
                cfg.training.seq_len,
                self.device,
                writers,
                cfg.debug.seed,
            )
            if cfg.eval.freq > 0
            else None
        )
        self.profiling = Profiling(cfg.job.dump_folder, cfg.profiling, self.rank, self.device.type)
        self._build_guards()

    def _build_guards(self) -> None:
        """Spike policy and skip limit, hang watchdog, test-only fault injection
        (docs/observability.md)."""
        ft = self.cfg.fault_tolerance
        self.step_guard = StepGuard.from_config(self.cfg.training, self.rank)
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
        self.checkpointer = self._checkpoint_manager()
        self.checkpointer.faults = self.faults  # test-only (tools/fault_injection.py)
        resumed = self.checkpointer.load()
        startup.mark("checkpoint load")
        if resumed is not None:
            self.step = resumed["step"]
        if not self.checkpointer.model_loaded:  # initialised only when nothing was loaded
            init_model_weights(self.cfg, self.model_parts, self.device)

    def _checkpoint_manager(self) -> CheckpointManager:
        cfg = self.cfg
        state = (self.model_parts, self.optimizer, self.lr_scheduler, self.dataloader)
        adapter = partial(self.spec.state_dict_adapter, self.model_args)
        folder, steps, settings = cfg.job.dump_folder, cfg.training.steps, resume_settings(cfg)
        return build_checkpointer(
            cfg.checkpoint, folder, steps, state, adapter, settings, self._checkpoint_extra()
        )

    def _checkpoint_extra(self) -> dict[str, Any]:
        """Checkpointed parts beyond the manager's own, by name (a training mode's state:
        torchtitan/training/posttrain.py): here DiLoCo's outer state under fault tolerance,
        else none (torchtitan/fault_tolerance/outer_state.py)."""
        return checkpoint_parts(self.cfg.fault_tolerance, self.model_parts)

    def _load_initial_only(self) -> None:
        """checkpoint.initial_load_path with checkpointing off: the weights (the model was
        initialised already: defers_init is off) are replaced by the folder's."""
        loader = self._checkpoint_manager()
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
        self.stepper = TrainStep(
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
            family=self.spec.hooks,
        )

    def _build_hooks(self) -> list[StepHook]:
        """The loop's optional features (``training/hooks/``). A subclass adds its own by
        extending this list; the loop calls them in its order."""
        timing = OffStepTime(self._phase, self.metrics.exclude_time)
        between = (self.validator, self.evaluator, self.profiling)
        ck = self.checkpointer
        checkpoint = (ck, self.global_tokens_per_step) if ck is not None else None
        mesh = self.parallel_dims.world_mesh
        return build_hooks(self.cfg, timing, self.watchdog, self.faults, between, checkpoint, mesh)

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Step ``self.step``: its (loss, grad norm) as device scalars."""
        return self.stepper.run(self.step)

    # ------------------------------------------------------------------ the loop
    def train(self) -> None:
        logger.info(f"training for {self.cfg.training.steps} steps")
        self.metrics.start_timer(self.step)
        for hook in self.hooks:
            hook.start(self.step)
        while self.step < self.cfg.training.steps:
            if self.replicas is not None:  # the last committed step; a recovering group's peer's
                self.step = self.replicas.start_step(self.step)
            self.step += 1
            for hook in self.hooks:  # gc, watchdog beat, test-only faults
                hook.before_step(self.step)
            group = self.optimizer.param_groups[0]  # the schedule's lr (x1, docs/optimizers.md)
            lr = group["lr"] / group.get("lr_mult", 1.0)
            loss, grad_norm = self.train_step()
            if self.replicas is not None and not self.replicas.committed:
                continue  # torchft discarded the step: start_step runs it again
            if self.stepper.rollback_pending:
                resumed = self.stepper.rollback(self.step)
                if resumed is not None:
                    self.step = resumed
                    continue
            self.metrics.end_step(loss, grad_norm, self.device_tokens_per_step, step=self.step)
            if self.metrics.should_log(self.step):
                self._phase("metrics log (cross-rank all-reduce)")
                self.metrics.log(self.step, lr)
            if (first := startup.first_step()) is not None:  # docs/performance.md
                logger.info(first)
            if (reason := self._after_step()) is not None:
                self.preempted_at = self.step
                logger.info(f"stopping after step {self.step} ({reason})")
                break
        for hook in self.hooks:
            hook.end()
        logger.info("training done")

    def _after_step(self) -> str | None:
        """The hooks after a step (validation, evaluation, profiler, checkpoint, timeouts), in
        order until one asks to stop: its reason."""
        for hook in self.hooks:
            if (reason := hook.after_step(self.step)) is not None:
                return reason
        return None

    def _phase(self, phase: str) -> None:
        if self.watchdog is not None:
            self.watchdog.phase(phase)

    def close(self) -> None:
        """Every hook (watchdog first, then the replica group, then the checkpointer, whose
        commit of a background save may fail: the rest are closed anyway), then the metrics."""
        closes = [*self.hooks, Closing(self.metrics.close, close_rank=80)]
        if self.replicas is not None:
            closes.append(Closing(self.replicas.close, close_rank=5))
        close_all(closes)
