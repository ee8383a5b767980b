"""The ``[lora]`` rules (docs/lora.md; part of ``validate_config``): the target patterns must
name adaptable modules of the model (checked on a ``meta`` build), and the combinations not
built are refused with the reason: QLoRA's NF4 base in a parallel layout, adapters with float8
linears, a DCP ``initial_load_path`` (checkpoints hold adapters only, so the base must come from
Hugging Face or the seed), and adapters on the output head under the chunked loss; a PEFT
``adapter_path`` must hold exactly the adapters built, at the same rank, alpha and use_rslora
(``lora/peft_io.py: check_adapters``; ``adapter_targets = "from_adapter"`` builds the folder's)."""

from __future__ import annotations

from pathlib import Path

import torch

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig, Lora
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.lora.apply import apply_lora, with_targets
from torchtitan.lora.layers import LoRAExperts, LoRALinear
from torchtitan.lora.peft_io import AdapterMismatch, check_adapters
from torchtitan.lora.qlora import nf4_shard_problem
from torchtitan.models import MODELS, flavor_args
from torchtitan.models.common.moe_experts import StackedExperts
from torchtitan.preflight.validate_weights import validate_peft_folder

__all__ = ["validate_lora"]


def validate_lora(cfg: JobConfig, dims: ParallelDims) -> None:
    lo = cfg.lora
    if not lo.enable:
        _check_needs_enable(lo)
        return
    if cfg.quantize.dense.float8.enable:
        raise ConfigError(
            "lora.enable",
            True,
            "adapters are not built on float8 linears",
            "remove --quantize.dense.float8.enable",
        )
    ck = cfg.checkpoint
    if ck.initial_load_path and not ck.initial_load_in_hf:
        raise ConfigError(
            "checkpoint.initial_load_path",
            ck.initial_load_path,
            "with lora.enable the base must be a Hugging Face folder (checkpoints hold adapters)",
            "add --checkpoint.initial_load_in_hf (export a DCP base with scripts/convert_to_hf.py)",
        )
    if lo.quantize_base == "nf4":
        _check_nf4_layout(dims)
    folder = Path(lo.adapter_path) if lo.adapter_path else None
    if folder is not None and not (folder / "adapter_config.json").is_file():
        raise ConfigError(
            "lora.adapter_path",
            lo.adapter_path,
            "must be a PEFT folder holding adapter_config.json",
            "point it at a folder written by scripts/export_lora.py or PEFT's save_pretrained",
        )
    validate_peft_folder(cfg)  # its files intact, before they are read (validate_weights.py)
    if lo.adapter_targets == "from_adapter" and (folder is None or lo.target_modules):
        raise ConfigError(
            "lora.adapter_targets",
            lo.adapter_targets,
            "takes the targets from lora.adapter_path's folder: it needs that folder and an "
            f"empty lora.target_modules (adapter_path {lo.adapter_path!r}, target_modules "
            f"{lo.target_modules})",
            "set --lora.adapter_path to a PEFT folder and leave lora.target_modules empty, or "
            "use --lora.adapter_targets config",
        )
    _check_targets(cfg, lo, dims)


_NEEDS_ENABLE = (
    ("quantize_base", "none", "an NF4 base exists only under adapters (QLoRA)"),
    ("adapter_path", "", "adapters are loaded only when LoRA trains"),
)


def _check_needs_enable(lo: Lora) -> None:
    """A ``[lora]`` option that changes what is built or loaded, set while LoRA is off, would be
    ignored: refused instead."""
    for name, off, why in _NEEDS_ENABLE:
        value = getattr(lo, name)
        if value != off:
            raise ConfigError(
                f"lora.{name}",
                value,
                f"needs lora.enable = true ({why})",
                f"add --lora.enable, or remove lora.{name}",
            )


def adaptable_targets(model: torch.nn.Module) -> list[str]:
    """The target patterns that exist in ``model``: the last two name parts of every module an
    adapter can wrap (``attention.wq``, ``feed_forward.w1``, ``feed_forward.experts``, ...)."""
    found: dict[str, None] = {}
    for fqn, module in model.named_modules():
        if fqn and (type(module) is torch.nn.Linear or isinstance(module, StackedExperts)):
            found[".".join(fqn.split(".")[-2:])] = None
    return list(found)


def _fix(model: torch.nn.Module) -> str:
    return f"use some of {','.join(adaptable_targets(model))} (docs/lora.md)"


def _check_targets(cfg: JobConfig, lo: Lora, dims: ParallelDims) -> None:
    spec = MODELS[cfg.model.name]
    args = flavor_args(cfg)  # the shapes decide what matches
    try:
        lo = with_targets(lo, spec, args)
    except AdapterMismatch as e:
        raise ConfigError("lora.adapter_path", lo.adapter_path, e.rule, e.fix) from None
    with torch.device("meta"):
        model = spec.build(args)
    fix = _fix(model)
    try:
        adapted = apply_lora(model, lo)
    except ValueError as e:
        raise ConfigError("lora.target_modules", lo.target_modules, str(e), fix) from None
    _check_rank(lo.rank, model, adapted)
    if lo.adapter_path:  # its adapters must be exactly the ones built, at the same rank
        try:
            check_adapters(Path(lo.adapter_path), spec.state_dict_adapter(args), model, lo)
        except AdapterMismatch as e:
            raise ConfigError("lora.adapter_path", lo.adapter_path, e.rule, e.fix) from None
    output = spec.parallel_plan(args).tensor_parallel.output
    if cfg.training.loss_chunk_size > 0 and output in adapted:
        raise ConfigError(
            "lora.target_modules",
            lo.target_modules,
            f"{output} is applied chunk by chunk by the chunked loss, without its adapter",
            "leave the output head out, or set training.loss_chunk_size = 0",
        )
    if lo.quantize_base == "nf4":
        for name in adapted:
            module = model.get_submodule(name)
            if not isinstance(module, LoRALinear):
                raise ConfigError(
                    "lora.quantize_base",
                    "nf4",
                    f"{name}: grouped experts have no NF4 form here",
                    "leave feed_forward.experts out of lora.target_modules, or set "
                    "lora.quantize_base = none",
                )
            problem = nf4_shard_problem(tuple(module.weight.shape), dims.dp_shard * dims.cp)
            if problem is not None:
                raise ConfigError("lora.quantize_base", "nf4", f"{name}: {problem}", fix)


def _widths(module: torch.nn.Module) -> list[tuple[int, int]]:
    """(in, out) of each adapted projection of an adapter module."""
    if isinstance(module, LoRALinear):
        return [(module.in_features, module.out_features)]
    assert isinstance(module, LoRAExperts)
    return [tuple(getattr(module, n).shape[1:]) for n in module.adapted]  # type: ignore[misc]


def _check_rank(rank: int, model: torch.nn.Module, adapted: list[str]) -> None:
    """A rank above a projection's smaller side adds no expressiveness (``B A`` has at most that
    rank) and costs more than the frozen weight: refused, naming the narrowest projection."""
    widths = [(min(w), name) for name in adapted for w in _widths(model.get_submodule(name))]
    width, name = min(widths)
    if rank > width:
        raise ConfigError(
            "lora.rank",
            rank,
            f"must be at most the smaller side of every adapted projection ({name} is "
            f"{width} wide): a larger rank adds parameters but no expressiveness",
            f"use a rank <= {width}, e.g. 8 or 16",
        )


_NF4_LAYOUTS = (
    ("tensor_parallel_degree", "tp", "tensor parallel would shard inside the NF4 codes"),
    ("data_parallel_replicate_degree", "dp_replicate", "NF4 bases are sharded by FSDP only"),
    ("context_parallel_degree", "cp", "not built with an NF4 base"),
)


def _check_nf4_layout(dims: ParallelDims) -> None:
    """QLoRA runs in one process, under FSDP (dp_shard) and under PP; the rest is refused."""
    for field, axis, why in _NF4_LAYOUTS:
        degree = getattr(dims, axis)
        if degree > 1:
            raise ConfigError(
                f"parallelism.{field}",
                degree,
                f"lora.quantize_base = nf4 runs under FSDP (dp_shard) and PP only: {why}",
                f"set parallelism.{field} = 1 (or lora.quantize_base = none)",
            )
