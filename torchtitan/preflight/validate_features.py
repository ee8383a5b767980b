"""Config checks for the features layered on training: compile, activation checkpointing,
float8, observability and checkpointing (part of ``validate_config``)."""

from __future__ import annotations

from pathlib import Path

from torchtitan.checkpoint.storage import complete_steps
from torchtitan.config.errors import ConfigError, require_int
from torchtitan.config.job_config import JobConfig
from torchtitan.config.sections import CHECKPOINT_PARTS, OPTIONAL_CHECKPOINT_PARTS
from torchtitan.distributed.activation_checkpoint import parse_selective_option
from torchtitan.distributed.float8 import float8_unsupported_reason
from torchtitan.distributed.pipeline_stages import SCHEDULES, normalize_schedule_name
from torchtitan.distributed.utils import device_type
from torchtitan.models import MODELS, flavor_args, flavor_of
from torchtitan.preflight.validate_weights import validate_hf_family


def validate_speed_features(cfg: JobConfig) -> None:
    """Activation checkpointing, compile and float8 options."""
    ac = cfg.activation_checkpoint
    if ac.mode == "selective":
        try:
            parse_selective_option(ac.selective_ac_option)
        except ValueError:
            raise ConfigError(
                "activation_checkpoint.selective_ac_option",
                ac.selective_ac_option,
                "must be an integer >= 1 (checkpoint every Nth block) or 'op'",
                "use e.g. 2 or op",
            ) from None

    c = cfg.compile
    unknown = [x for x in c.components if x not in ("model", "loss")]
    if unknown or (c.enable and not c.components):
        raise ConfigError(
            "compile.components",
            c.components,
            "must list model and/or loss",
            "use model,loss",
        )

    f8 = cfg.quantize.dense.float8
    if not f8.enable:
        return
    if f8.enable_fsdp_float8_all_gather and f8.recipe_name != "tensorwise":
        raise ConfigError(
            "quantize.dense.float8.enable_fsdp_float8_all_gather",
            True,
            f"float8 all-gather of FSDP parameters needs the tensorwise recipe, not {f8.recipe_name}",
            "remove --quantize.dense.float8.enable_fsdp_float8_all_gather or use recipe_name "
            "tensorwise",
        )
    if f8.precompute_float8_dynamic_scale_for_fsdp and not f8.enable_fsdp_float8_all_gather:
        raise ConfigError(
            "quantize.dense.float8.precompute_float8_dynamic_scale_for_fsdp",
            True,
            "precomputes the scales that float8 all-gather uses, so it needs "
            "enable_fsdp_float8_all_gather",
            "add --quantize.dense.float8.enable_fsdp_float8_all_gather or remove the flag",
        )
    reason = float8_unsupported_reason(device_type(), emulate=f8.emulate)
    if reason is not None:
        raise ConfigError(
            "quantize.dense.float8.enable",
            True,
            f"float8 training cannot run here: {reason}",
            "remove --quantize.dense.float8.enable, or add --quantize.dense.float8.emulate to "
            "check the numerics without float8 hardware (no speed-up)",
        )


def validate_observability(cfg: JobConfig) -> None:
    """Metrics, memory monitor, profiling, validation and non-finite checks."""
    m, prof, val = cfg.metrics, cfg.profiling, cfg.validation
    require_int(cfg, "metrics.memory_warmup_steps", minimum=0)
    if m.memory_leak_window != 0 and m.memory_leak_window < 8:
        raise ConfigError(
            "metrics.memory_leak_window",
            m.memory_leak_window,
            "must be 0 (detector off) or at least 8 steps (the trend test compares quarters)",
            "use 20, or 0 to turn the leak detector off",
        )
    if not m.memory_leak_min_growth_mib > 0:
        raise ConfigError(
            "metrics.memory_leak_min_growth_mib",
            m.memory_leak_min_growth_mib,
            "must be > 0",
            "use e.g. 16 (MiB over one leak window)",
        )
    if prof.enable_profiling:
        require_int(cfg, "profiling.profile_freq")
        require_int(cfg, "profiling.profiler_warmup", minimum=0)
        require_int(cfg, "profiling.profiler_active")
        if prof.profiler_warmup + prof.profiler_active > prof.profile_freq:
            raise ConfigError(
                "profiling.profile_freq",
                prof.profile_freq,
                f"must hold profiler_warmup + profiler_active = "
                f"{prof.profiler_warmup} + {prof.profiler_active} steps",
                f"use profile_freq >= {prof.profiler_warmup + prof.profiler_active}, or fewer "
                "warm-up/active steps",
            )
    if prof.enable_memory_snapshot:
        if device_type() != "cuda":
            raise ConfigError(
                "profiling.enable_memory_snapshot",
                True,
                "CUDA memory snapshots need a CUDA device (the caching allocator records them); "
                "this machine has none. CPU profiler traces work: profiling.enable_profiling",
                "remove --profiling.enable_memory_snapshot, or run on a GPU",
            )
        require_int(cfg, "profiling.profile_freq")
    if val.enable:
        require_int(cfg, "validation.freq")
        if cfg.parallelism.pipeline_parallel_degree > 1:
            name = normalize_schedule_name(cfg.parallelism.pipeline_parallel_schedule)
            if SCHEDULES[name].v_shaped:
                # torch 2.13: schedule.eval() on a V-shaped schedule still runs the backward
                # actions of the two stages that share a rank and fails ("can't steal_bwd_input
                # if this stage doesn't have backward").
                raise ConfigError(
                    "validation.enable",
                    True,
                    f"validation runs the pipeline forward-only (torch's schedule.eval), which "
                    f"torch 2.13 cannot do for the V-shaped schedule {name}",
                    "use a looped schedule (1F1B, Interleaved1F1B, InterleavedZeroBubble, ...) "
                    "with validation, or turn validation off",
                )
        if val.steps == 0 or val.steps < -1:
            raise ConfigError(
                "validation.steps",
                val.steps,
                "must be a number of batches >= 1, or -1 for the whole split",
                "use e.g. 10, or -1",
            )


def validate_checkpoint(cfg: JobConfig, world_size: int) -> None:
    """Checkpoint options (checked even with checkpoint.enable off, so a typo fails early)."""
    ck = cfg.checkpoint
    if ck.create_seed_checkpoint:
        validate_seed_checkpoint(cfg, world_size)
    if ck.export_dtype != "float32" and not ck.last_save_model_only:
        raise ConfigError(
            "checkpoint.export_dtype",
            ck.export_dtype,
            "applies only to the model-only checkpoint of checkpoint.last_save_model_only, "
            "which is off",
            "add --checkpoint.last_save_model_only, or drop export_dtype",
        )
    require_int(cfg, "checkpoint.interval")
    require_int(cfg, "checkpoint.keep_latest_k", minimum=0)
    if ck.load_step < -1:
        raise ConfigError(
            "checkpoint.load_step",
            ck.load_step,
            "must be -1 (the newest valid checkpoint) or a step >= 0",
            "use -1, or the N of an existing step-N folder",
        )
    if ck.folder.strip() in ("", "."):
        raise ConfigError(
            "checkpoint.folder",
            ck.folder,
            "must name a sub-folder of job.dump_folder (old checkpoints in it are deleted)",
            "use e.g. checkpoint",
        )
    unknown = sorted(set(ck.exclude_from_loading) - CHECKPOINT_PARTS - OPTIONAL_CHECKPOINT_PARTS)
    if unknown:
        raise ConfigError(
            "checkpoint.exclude_from_loading",
            ck.exclude_from_loading,
            f"{unknown} are not parts of a checkpoint",
            f"use some of {sorted(CHECKPOINT_PARTS | OPTIONAL_CHECKPOINT_PARTS)}",
        )
    if ck.initial_load_path and not Path(ck.initial_load_path).is_dir():
        raise ConfigError(
            "checkpoint.initial_load_path",
            ck.initial_load_path,
            "is not a folder",
            "give a step-N checkpoint folder, or a Hugging Face folder with initial_load_in_hf",
        )
    if ck.initial_load_in_hf:
        if not ck.initial_load_path:
            raise ConfigError(
                "checkpoint.initial_load_in_hf",
                True,
                "needs checkpoint.initial_load_path (the Hugging Face folder)",
                "set --checkpoint.initial_load_path",
            )
        spec = MODELS.get(cfg.model.name)
        flavor = spec.flavors.get(flavor_of(cfg)) if spec is not None else None
        if spec is not None and flavor is not None and spec.state_dict_adapter(flavor) is None:
            raise ConfigError(
                "checkpoint.initial_load_in_hf",
                True,
                f"needs a Hugging Face weight converter (ModelSpec.state_dict_adapter), and "
                f"{cfg.model.name} has none",
                "convert the weights yourself and remove the flag",
            )
        if not list(Path(ck.initial_load_path).glob("*.safetensors")):
            raise ConfigError(
                "checkpoint.initial_load_path",
                ck.initial_load_path,
                "holds no *.safetensors files (initial_load_in_hf is set)",
                "point it at a Hugging Face model folder",
            )
        if spec is not None and flavor is not None:
            validate_hf_family(cfg)  # readable, a family we train, the run's (validate_weights)
    if ck.async_mode == "async_with_pinned_mem" and device_type() != "cuda":
        raise ConfigError(
            "checkpoint.async_mode",
            ck.async_mode,
            "pinned host memory needs CUDA, and this machine has no GPU",
            "use async (a background thread) or disabled",
        )


def validate_seed_checkpoint(cfg: JobConfig, world_size: int) -> None:
    """A seed checkpoint is made by one process with every parallel degree 1, into an empty
    checkpoint folder (a newer checkpoint there would be resumed instead of the seed)."""
    ck, p = cfg.checkpoint, cfg.parallelism
    if not ck.enable:
        raise ConfigError(
            "checkpoint.create_seed_checkpoint",
            True,
            "writes into the checkpoint folder, and checkpoint.enable is off",
            "add --checkpoint.enable",
        )
    if world_size != 1:
        raise ConfigError(
            "checkpoint.create_seed_checkpoint",
            True,
            f"runs on one process, and this launch has {world_size} (WORLD_SIZE)",
            "make the seed with NGPU=1 (or plain python), then start the parallel run",
        )
    for name in (
        "data_parallel_replicate_degree",
        "data_parallel_shard_degree",
        "tensor_parallel_degree",
        "pipeline_parallel_degree",
        "context_parallel_degree",
    ):
        value = getattr(p, name)
        if value != 1 and not (name == "data_parallel_shard_degree" and value == -1):
            raise ConfigError(
                f"parallelism.{name}",
                value,
                "must be 1 with checkpoint.create_seed_checkpoint (the seed is made on one "
                "process, every parallel degree 1; the run that loads it may use any)",
                f"set --parallelism.{name} 1 for the seed run",
            )
    root = Path(cfg.job.dump_folder) / ck.folder
    if complete_steps(root):
        raise ConfigError(
            "checkpoint.create_seed_checkpoint",
            True,
            f"{root} already holds checkpoints (steps {complete_steps(root)}), which a run "
            "would resume from instead of the seed",
            "use a fresh job.dump_folder or checkpoint.folder",
        )


def validate_attention(cfg: JobConfig, cp: int) -> None:
    """The attention mask and kernel can run here (docs/attention.md); a family's own kernel
    check (its args' ``device_problem``: Qwen3.5's flash-linear-attention, docs/qwen3_5.md)."""
    m = cfg.model
    device_problem = getattr(MODELS[m.name].flavors.get(flavor_of(cfg)), "device_problem", None)
    if callable(device_problem) and (problem := device_problem(device_type())) is not None:
        raise problem
    block = m.attn_mask_type == "block_causal"
    if block:
        spec = MODELS[m.name]
        if not spec.parallel_plan(flavor_args(cfg)).document_mask:
            raise ConfigError(
                "model.attn_mask_type",
                m.attn_mask_type,
                f"model {m.name} does not take document ids (its plan has document_mask=False)",
                "use causal, or a model family with block-causal attention (llama3)",
            )
    if cfg.training.document_positions and not block:
        raise ConfigError(
            "training.document_positions",
            True,
            "per-document positions need attention that stays within each document, and "
            f"model.attn_mask_type is {m.attn_mask_type!r}",
            "add --model.attn_mask_type block_causal, or drop --training.document_positions",
        )
    if m.attn_backend == "flex" and device_type() != "cuda":
        raise ConfigError(
            "model.attn_backend",
            "flex",
            "FlexAttention needs CUDA here: torch 2.13 has no FlexAttention backward on CPU",
            "use auto or sdpa (the exact dense-mask path)",
        )
    if m.attn_backend == "flex" and cp > 1 and cfg.parallelism.context_parallel_method == "ring":
        raise ConfigError(
            "model.attn_backend",
            "flex",
            "FlexAttention under context parallel is built for the allgather method only (the "
            "ring's steps attend with SDPA)",
            "use --parallelism.context_parallel_method allgather, or model.attn_backend sdpa",
        )
    if cfg.parallelism.context_parallel_load_balancer == "document" and not block:
        raise ConfigError(
            "parallelism.context_parallel_load_balancer",
            "document",
            "the document balancer splits every packed document over the cp ranks, and "
            f"model.attn_mask_type is {m.attn_mask_type!r} (one causal sequence, which "
            "headtail already balances)",
            "add --model.attn_mask_type block_causal, or use headtail",
        )
    p = cfg.parallelism
    if (
        block
        and p.context_parallel_method == "ring"
        and p.context_parallel_rotate_method != "allgather"
    ):
        raise ConfigError(
            "parallelism.context_parallel_rotate_method",
            p.context_parallel_rotate_method,
            "block_causal ring attention runs our document ring, which passes each K/V shard "
            "to the next cp rank point to point; the rotate method applies to torch's ring "
            "(causal) only",
            "drop --parallelism.context_parallel_rotate_method",
        )
