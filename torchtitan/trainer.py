"""The Trainer: builds everything in the order of DESIGN section 3, then runs the loop.

Read top-down: ``__init__`` is the build order, ``train_step`` is one optimizer step with
gradient accumulation, ``train`` is the loop with metrics at ``log_freq``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections.abc import Iterator

import torch
from torch import nn

from torchtitan.components.dataloader import build_dataloader
from torchtitan.components.loss import cross_entropy_loss
from torchtitan.components.lr_scheduler import build_lr_scheduler
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.metrics_writers import build_writers
from torchtitan.components.optimizer import build_optimizer
from torchtitan.components.tokenizer import build_tokenizer
from torchtitan.config.job_config import JobConfig
from torchtitan.config.manager import to_toml
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models import MODELS
from torchtitan.tools.logging import init_logger, logger
from torchtitan.tools.peak_flops import datasheet_peak_flops, measure_matmul_peak_flops

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
        self.parallel_dims = dims = ParallelDims(
            dp_replicate=p.data_parallel_replicate_degree,
            dp_shard=p.data_parallel_shard_degree,
            cp=p.context_parallel_degree,
            tp=p.tensor_parallel_degree,
            pp=p.pipeline_parallel_degree,
            world_size=world_size,
        )
        dims.build_mesh(self.device.type)
        init_logger(prefix=f"[{dims.describe_rank(self.rank)}] ")
        logger.info(f"{cfg.job.description}: world size {world_size}, device {self.device}, {dims}")
        if cfg.job.print_config:
            logger.info("resolved config:\n" + to_toml(cfg))
        dist_utils.set_determinism(cfg.debug.seed, cfg.debug.deterministic)

        # 2. Tokenizer and data, sharded by the data-parallel coordinates only.
        self.tokenizer = build_tokenizer(cfg.model.tokenizer_path)
        dp_mesh = dims.get_mesh("dp")
        self.dataloader = build_dataloader(
            dataset=t.dataset,
            dataset_path=t.dataset_path,
            tokenizer=self.tokenizer,
            seq_len=t.seq_len,
            local_batch_size=t.local_batch_size,
            dp_rank=dp_mesh.get_local_rank(),
            dp_world_size=dp_mesh.size(),
            sharding=t.data_sharding,
        )
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

        # 4. Parallelize (the model's fixed-order plan), then materialize and initialize.
        self.param_dtype = resolve_param_dtype(t.mixed_precision_param, self.device)
        reduce_dtype = _DTYPES[t.mixed_precision_reduce]
        self.model = spec.parallelize(model, dims, cfg, self.param_dtype, reduce_dtype)
        # The modules this rank trains (several pipeline stages per rank under PP).
        self.model_parts: list[nn.Module] = [self.model]
        for part in self.model_parts:
            part.to_empty(device=self.device)
            part.init_weights(seed=cfg.debug.seed, buffer_device=self.device)  # type: ignore[operator]
            part.train()

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
        )
        # Tokens per step that count for this device: a rank's data-parallel share, divided
        # among the ranks that split the same tokens (TP, CP, PP).
        self.tokens_per_step = t.local_batch_size * t.seq_len * self.grad_accum_steps
        self.device_tokens_per_step = self.tokens_per_step // dims.non_data_parallel_size
        self.step = 0
        self.data_iter: Iterator | None = None
        logger.info(
            f"global batch {global_batch} sequences = local {t.local_batch_size} x dp {dims.dp_degree} "
            f"x grad accum {self.grad_accum_steps}; seq_len {t.seq_len}; param dtype {self.param_dtype}"
        )

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.data_iter is None:
            self.data_iter = iter(self.dataloader)
        inputs, labels = next(self.data_iter)
        return inputs.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)

    def train_context(self) -> contextlib.ExitStack:
        """Contexts around forward and loss: autocast where no FSDP/DDP policy casts parameters."""
        stack = contextlib.ExitStack()
        dims = self.parallel_dims
        if self.param_dtype != torch.float32 and not (dims.fsdp_enabled or dims.ddp_enabled):
            stack.enter_context(torch.autocast(self.device.type, dtype=self.param_dtype))
        return stack

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Forward, loss and backward of one microbatch; returns the detached, scaled loss."""
        with self.train_context():
            logits = self.model(inputs)
            # Scale so the accumulated gradient is the mean over the whole global batch.
            loss = cross_entropy_loss(logits, labels) / self.grad_accum_steps
        del logits
        loss.backward()
        return loss.detach()

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over ``grad_accum_steps`` microbatches; returns (loss, grad norm)."""
        self.optimizer.zero_grad(set_to_none=True)
        step_loss = torch.zeros((), device=self.device)
        for _ in range(self.grad_accum_steps):
            inputs, labels = self.next_batch()
            step_loss += self.forward_backward(inputs, labels)
        grad_norm = dist_utils.clip_grad_norm_(
            [p for part in self.model_parts for p in part.parameters()],
            self.cfg.training.max_norm,
            pp_mesh=self.parallel_dims.get_mesh("pp") if self.parallel_dims.pp_enabled else None,
        )
        self.optimizer.step()
        self.lr_scheduler.step()
        return step_loss, grad_norm

    def train(self) -> None:
        cfg = self.cfg
        gc_freq = cfg.training.gc_freq
        if gc_freq > 0:
            gc.disable()
        logger.info(f"training for {cfg.training.steps} steps")
        self.metrics.start_timer()
        while self.step < cfg.training.steps:
            self.step += 1
            if gc_freq > 0 and self.step % gc_freq == 0:
                gc.collect(1)
            lr = self.optimizer.param_groups[0]["lr"]
            loss, grad_norm = self.train_step()
            self.metrics.end_step(loss, grad_norm, self.device_tokens_per_step)
            if self.metrics.should_log(self.step):
                self.metrics.log(self.step, lr)
            if self.step == 1:
                dist_utils.set_pg_timeouts(
                    cfg.comm.train_timeout_seconds, self.parallel_dims.world_mesh
                )
        logger.info("training done")

    def close(self) -> None:
        self.metrics.close()
        gc.enable()
