"""The Trainer: builds everything in the order of DESIGN section 3, then runs the loop.

Read top-down: ``__init__`` is the build order, ``train_step`` is one optimizer step with
gradient accumulation, ``train`` is the loop with metrics at ``log_freq``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor.parallel import loss_parallel

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.dataloader import ParallelAwareDataloader, build_dataloader
from torchtitan.components.loss import cross_entropy_loss
from torchtitan.components.lr_scheduler import build_lr_scheduler
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.metrics_writers import MetricWriter, build_writers
from torchtitan.components.nonfinite import NonFiniteGuard
from torchtitan.components.optimizer import build_optimizer
from torchtitan.components.tokenizer import build_tokenizer
from torchtitan.components.validate import Validator
from torchtitan.config.job_config import JobConfig
from torchtitan.config.manager import to_toml
from torchtitan.config.validate import pipeline_plan
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.compile import compile_loss, set_compile_cache_dir
from torchtitan.distributed.context_parallel import ContextParallel
from torchtitan.distributed.float8 import apply_float8, register_float8_precompute_hook
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.pipeline_parallel import Pipeline, build_pipeline, split_model
from torchtitan.models import MODELS
from torchtitan.tools.logging import init_logger, logger
from torchtitan.tools.memory import DeviceMemoryMonitor
from torchtitan.tools.memory_monitor import MemoryMonitor
from torchtitan.tools.peak_flops import datasheet_peak_flops, measure_matmul_peak_flops
from torchtitan.tools.profiling import Profiling

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_param_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` is bf16 on CUDA (tensor cores) and fp32 on CPU (bf16 matmuls are slow there)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


class Trainer:
    def __init__(self, cfg: JobConfig) -> None:
        self.cfg = cfg
        t, p = cfg.training, cfg.parallelism

        # 1. Process group, then the mesh. Degrees were validated before we got here.
        self.device, world_size, self.rank = dist_utils.init_distributed(
            cfg.comm.init_timeout_seconds
        )
        self.parallel_dims = dims = ParallelDims.from_config(p, world_size)
        dims.build_mesh(self.device.type)
        # Pipeline split and microbatches (validated already); None without PP.
        self.pp_plan = pipeline_plan(cfg)
        self.pp_stage_ids = self.pp_plan.stage_ids(dims.coordinates()["pp"]) if self.pp_plan else []
        init_logger(prefix=f"[{dims.describe_rank(self.rank)}{self._stages_text()}] ")
        logger.info(f"{cfg.job.description}: world size {world_size}, device {self.device}, {dims}")
        if cfg.job.print_config:
            logger.info("resolved config:\n" + to_toml(cfg))
        dist_utils.set_determinism(cfg.debug.seed, cfg.debug.deterministic)

        # 2. Tokenizer and data, sharded by the data-parallel coordinates only.
        self.tokenizer = build_tokenizer(cfg.model.tokenizer_path)
        self.dataloader = self._build_dataloader(t.dataset, t.dataset_path, "train", infinite=True)
        global_batch = (
            t.global_batch_size if t.global_batch_size > 0 else t.local_batch_size * dims.dp_degree
        )
        self.grad_accum_steps = global_batch // (t.local_batch_size * dims.dp_degree)

        # 3. Model on meta: no memory is used until the parallelized model is materialized.
        spec = MODELS[cfg.model.name]
        self.model_args = dataclasses.replace(
            spec.flavors[cfg.model.flavor],
            vocab_size=self.tokenizer.vocab_size,
            max_seq_len=t.seq_len,
        )
        with torch.device("meta"):
            model = spec.model_cls(self.model_args)
        n_params = self.model_args.num_params()
        logger.info(f"model {cfg.model.name} {cfg.model.flavor}: {n_params:,} parameters")
        # Converters, on the meta model before any parallelism: float8 linears (torchao).
        f8 = cfg.quantize.dense.float8
        if f8.enable:
            apply_float8(
                model,
                recipe_name=f8.recipe_name,
                filter_fqns=f8.filter_fqns,
                auto_filter_small_kn=f8.auto_filter_small_kn,
                enable_fsdp_float8_all_gather=f8.enable_fsdp_float8_all_gather
                and dims.fsdp_enabled,
                emulate=f8.emulate,
                device_type=self.device.type,
            )
        # The loss function; compiled (lazily, at its first call) when compile lists it.
        self.loss_fn = cross_entropy_loss
        if cfg.compile.enable:
            # Ranks at different TP/CP coordinates compile different graphs: separate caches.
            coords = dims.coordinates()
            cache = set_compile_cache_dir(
                cfg.compile.cache_dir,
                base_folder=cfg.job.dump_folder,
                rank_subdir=f"tp{coords['tp']}_cp{coords['cp']}"
                if dims.tp_enabled or dims.cp_enabled
                else None,
            )
            logger.info(f"compile cache: {cache}")
            if "loss" in cfg.compile.components:
                self.loss_fn = compile_loss(cross_entropy_loss, backend=cfg.compile.backend)

        # 4. Parallelize (the model's fixed-order plan), then materialize and initialize.
        self.param_dtype = resolve_param_dtype(t.mixed_precision_param, self.device)
        reduce_dtype = _DTYPES[t.mixed_precision_reduce]
        # The modules this rank trains: under PP, one copy of the meta model per local stage
        # with only what that stage owns, each parallelized on its own.
        self.model_parts: list[nn.Module] = [
            spec.parallelize(part, dims, cfg, self.param_dtype, reduce_dtype)
            for part in (
                [split_model(model, self.pp_plan.stage_units[i]) for i in self.pp_stage_ids]
                if self.pp_plan
                else [model]
            )
        ]
        self.model = self.model_parts[0]
        for part in self.model_parts:
            part.to_empty(device=self.device)
            part.init_weights(seed=cfg.debug.seed, buffer_device=self.device)  # type: ignore[operator]
            part.train()
        self.pipeline: Pipeline | None = None
        if self.pp_plan is not None:
            self.pipeline = build_pipeline(
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
            mb = t.local_batch_size // n_mb
            logger.info(
                f"pipeline {self.pp_plan.schedule}: {self.pp_plan.num_stages} stages, {n_mb} "
                f"microbatches of {mb} sequence{'s' if mb > 1 else ''}; {self.pp_plan.describe()}"
            )

        # Context parallel: each rank trains on its load-balanced share of every sequence.
        self.cp: ContextParallel | None = None
        if dims.cp_enabled:
            p = cfg.parallelism
            self.cp = ContextParallel(
                dims.get_mesh("cp"),
                p.context_parallel_method,
                self.model_parts,
                rotate_method=p.context_parallel_rotate_method,
            )

        # 5. Optimizer and LR schedule.
        o, s = cfg.optimizer, cfg.lr_scheduler
        self.optimizer = build_optimizer(
            self.model_parts,
            o.name,
            o.lr,
            (o.beta1, o.beta2),
            o.eps,
            o.weight_decay,
            o.implementation,
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
        if f8.enable and f8.precompute_float8_dynamic_scale_for_fsdp and dims.fsdp_enabled:
            register_float8_precompute_hook(self.optimizer, self.model_parts)

        # 6. Metrics. MFU needs a peak: the datasheet's for a known GPU, else measured here.
        peak = datasheet_peak_flops(self.device, self.param_dtype)
        source = "datasheet"
        if peak is None:
            peak, source = (
                measure_matmul_peak_flops(self.device, self.param_dtype),
                "measured matmul",
            )
        logger.info(f"peak {self.param_dtype} FLOP/s for MFU: {peak / 1e12:.3f} T ({source})")
        m = cfg.metrics
        writers = build_writers(
            cfg.job.dump_folder,
            enable_jsonl=m.enable_jsonl,
            enable_tensorboard=m.enable_tensorboard,
            enable_wandb=m.enable_wandb,
            tb_folder=m.save_tb_folder,
            rank=self.rank,
            write_this_rank=m.save_for_all_ranks or self.rank == 0,
            config_dict=dataclasses.asdict(cfg),
            run_name=cfg.job.description,
        )
        self.metrics = MetricsProcessor(
            device=self.device,
            log_freq=m.log_freq,
            total_steps=t.steps,
            loss_mesh=dims.get_mesh("dp_cp"),
            flops_per_token=self.model_args.flops_per_token(t.seq_len),
            peak_flops=peak,
            peak_flops_source=source,
            writers=writers,
            pp_mesh=dims.get_mesh("pp") if self.pp_plan else None,
            pp_loss_rank=self.pp_plan.last_stage_pp_rank if self.pp_plan else 0,
            memory_monitor=MemoryMonitor(
                DeviceMemoryMonitor(self.device),
                rank=self.rank,
                warmup_steps=m.memory_warmup_steps,
                leak_window=m.memory_leak_window,
                leak_min_growth_mib=m.memory_leak_min_growth_mib,
                trace_path=f"{cfg.job.dump_folder}/memory/rank_{self.rank}.jsonl"
                if m.enable_memory_trace
                else None,
            ),
            cross_rank_view=m.enable_cross_rank_view,
        )
        # 7. Observability (docs/observability.md): non-finite guard, validation, profiler.
        self.nonfinite = NonFiniteGuard(
            t.nonfinite_policy, rank=self.rank, stage_ids=self.pp_stage_ids or None
        )
        self.validator = self._build_validator(writers) if cfg.validation.enable else None
        pr = cfg.profiling
        self.profiling = Profiling(
            cfg.job.dump_folder,
            enable_profiling=pr.enable_profiling,
            traces_folder=pr.save_traces_folder,
            profile_freq=pr.profile_freq,
            warmup=pr.profiler_warmup,
            active=pr.profiler_active,
            enable_memory_snapshot=pr.enable_memory_snapshot,
            snapshot_folder=pr.save_memory_snapshot_folder,
            rank=self.rank,
            device_type=self.device.type,
        )
        # Tokens per step that count for this device: a rank's data-parallel share, divided
        # among the ranks that split the same tokens (TP, CP, PP).
        self.tokens_per_step = t.local_batch_size * t.seq_len * self.grad_accum_steps
        self.device_tokens_per_step = self.tokens_per_step // dims.non_data_parallel_size
        self.step = 0
        self.data_iter: Iterator | None = None
        # 7. Checkpoints: resume from the newest valid one (model, optimizer, LR, data, RNG).
        self.checkpointer: CheckpointManager | None = None
        self.global_tokens_per_step = global_batch * t.seq_len
        if cfg.checkpoint.enable:
            ck = cfg.checkpoint
            self.checkpointer = CheckpointManager(
                root=Path(cfg.job.dump_folder) / ck.folder,
                interval=ck.interval,
                keep_latest_k=ck.keep_latest_k,
                async_mode=ck.async_mode,
                load_step=ck.load_step,
                total_steps=t.steps,
                model_parts=self.model_parts,
                optimizer=self.optimizer,
                lr_scheduler=self.lr_scheduler,
                dataloader=self.dataloader,
                verify_checksums=ck.verify_checksums,
                exclude_from_loading=tuple(ck.exclude_from_loading),
                initial_load_path=ck.initial_load_path,
                initial_load_model_only=ck.initial_load_model_only,
                initial_load_in_hf=ck.initial_load_in_hf,
                hf_adapter=spec.state_dict_adapter(self.model_args)
                if ck.initial_load_in_hf and spec.state_dict_adapter is not None
                else None,
                last_save_model_only=ck.last_save_model_only,
                export_dtype=getattr(torch, ck.export_dtype),
            )
            resumed = self.checkpointer.load()
            if resumed is not None:
                self.step = resumed["step"]
        logger.info(
            f"global batch {global_batch} sequences = local {t.local_batch_size} x dp {dims.dp_degree} "
            f"x grad accum {self.grad_accum_steps}; seq_len {t.seq_len}; param dtype {self.param_dtype}"
        )

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        start = time.perf_counter()
        if self.data_iter is None:
            self.data_iter = iter(self.dataloader)
        inputs, labels = next(self.data_iter)
        self.metrics.add_data_time(time.perf_counter() - start)
        return inputs.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)

    def _build_dataloader(
        self, dataset: str, dataset_path: str | None, split: str, infinite: bool
    ) -> ParallelAwareDataloader:
        """A loader sharded by this rank's data-parallel coordinate only (TP/CP/PP peers share)."""
        t, dp_mesh = self.cfg.training, self.parallel_dims.get_mesh("dp")
        return build_dataloader(
            dataset=dataset,
            dataset_path=dataset_path,
            tokenizer=self.tokenizer,
            seq_len=t.seq_len,
            local_batch_size=t.local_batch_size,
            dp_rank=dp_mesh.get_local_rank(),
            dp_world_size=dp_mesh.size(),
            split=split,
            infinite=infinite,
            sharding=t.data_sharding,
        )

    def _build_validator(self, writers: list[MetricWriter]) -> Validator:
        v, dims = self.cfg.validation, self.parallel_dims
        loader = self._build_dataloader(v.dataset, v.dataset_path, "validation", infinite=False)
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

    def validation_loss(
        self, inputs: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, int] | None:
        """Summed token loss and token count of one validation batch, forward only (the
        Validator's hook). Under PP only the last stage has a loss: ``None`` elsewhere."""
        if self.pipeline is not None:
            # Forward-only run of the same schedule. pipeline_loss divides each microbatch's
            # mean by microbatches x accumulation, so the sum times accumulation is the mean.
            with self.train_context(), self.sequence_share(inputs, labels) as (inputs, labels):
                summed = self.pipeline.eval(inputs, labels)
            if summed is None:
                return None
            mean = summed * self.grad_accum_steps
            return dist_utils.local_tensor(mean) * labels.numel(), labels.numel()
        with self.train_context(), self.sequence_share(inputs, labels) as (inputs, labels):
            loss = self.loss_fn(self.model(inputs), labels)
        return dist_utils.local_tensor(loss.detach()) * labels.numel(), labels.numel()

    def sequence_share(
        self, inputs: torch.Tensor, labels: torch.Tensor
    ) -> contextlib.AbstractContextManager[tuple[torch.Tensor, torch.Tensor]]:
        """A context around forward (and backward) yielding the inputs and labels this rank
        computes on: the whole batch, or under context parallel its share of every sequence."""
        if self.cp is None:
            return contextlib.nullcontext((inputs, labels))
        return self.cp.batch(inputs, labels)

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
        scale = self.pp_plan.n_microbatches * self.grad_accum_steps
        return self.loss_fn(logits, labels) / scale

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Forward, loss and backward of one microbatch; returns the detached, scaled loss."""
        if self.pipeline is not None:
            with self.train_context(), self.sequence_share(inputs, labels) as (inputs, labels):
                loss = self.pipeline.step(inputs, labels)
            # Only the last stage has a loss. Elsewhere this zero stays in the rank's running sum
            # and is never shown: at log steps the metrics take the last stage's values.
            if loss is None:
                return torch.zeros((), device=self.device)
            return dist_utils.local_tensor(loss)
        with self.train_context(), self.sequence_share(inputs, labels) as (inputs, labels):
            logits = self.model(inputs)
            # Scale so the accumulated gradient is the mean over the whole global batch.
            loss = self.loss_fn(logits, labels) / self.grad_accum_steps
            del logits
            loss.backward()
        # Under loss parallel the loss is a replicated DTensor: keep its (full) local value.
        return dist_utils.local_tensor(loss.detach())

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over ``grad_accum_steps`` microbatches; returns (loss, grad norm)."""
        self.optimizer.zero_grad(set_to_none=True)
        step_loss = torch.zeros((), device=self.device)
        for _ in range(self.grad_accum_steps):
            inputs, labels = self.next_batch()
            step_loss += self.forward_backward(inputs, labels)
        params = [p for part in self.model_parts for p in part.parameters()]
        # Measure the norm (max_norm 0), check it, then clip: clipping by a NaN norm would make
        # every gradient NaN and hide the parameter where the NaN appeared.
        grad_norm = dist_utils.clip_grad_norm_(
            params,
            0.0,
            pp_mesh=self.parallel_dims.get_mesh("pp") if self.parallel_dims.pp_enabled else None,
        )
        # A NaN/inf loss or norm raises, or (skip_step) keeps the weights and optimizer state.
        if self.nonfinite.check(self.step, step_loss, grad_norm, self.model_parts):
            if self.cfg.training.max_norm > 0:
                dist_utils.clip_grads_with_norm_(params, self.cfg.training.max_norm, grad_norm)
            self.optimizer.step()
        else:
            self.metrics.skipped_steps = self.nonfinite.skipped_steps
        self.lr_scheduler.step()
        return step_loss, grad_norm

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
            lr = self.optimizer.param_groups[0]["lr"]
            loss, grad_norm = self.train_step()
            self.metrics.end_step(loss, grad_norm, self.device_tokens_per_step, step=self.step)
            if self.metrics.should_log(self.step):
                self.metrics.log(self.step, lr)
            if self.validator is not None and self.validator.should_validate(self.step):
                start = time.perf_counter()
                self.validator.validate(self.step)
                self.metrics.exclude_time(time.perf_counter() - start)
            self.profiling.step(self.step)
            if self.checkpointer is not None:
                start = time.perf_counter()
                stop = self.checkpointer.step_end(
                    self.step, self.step * self.global_tokens_per_step
                )
                self.metrics.exclude_time(time.perf_counter() - start)
                if stop:
                    logger.info(f"stopping after step {self.step} (preemption signal)")
                    break
            if self.step == 1:
                dist_utils.set_pg_timeouts(
                    cfg.comm.train_timeout_seconds, self.parallel_dims.world_mesh
                )
        logger.info("training done")

    def close(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.close()
        self.profiling.stop()
        self.metrics.close()
        gc.enable()
