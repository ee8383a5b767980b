"""Float8 training of linear layers through torchao.

``apply_float8`` runs on the model while it is still on the ``meta`` device, before any
parallelism: it swaps the eligible ``nn.Linear`` modules for torchao's ``Float8Linear`` (same
parameter names and shapes; the matmuls cast their operands to float8 with dynamic scales).
Tensor parallel, compile and FSDP2 then apply to the converted model as to any other.

Which linears are converted:

* never one whose name contains an entry of ``filter_fqns`` (default ``["output"]``: the output
  projection is the most sensitive to precision and its wide vocab matmul is kept in high
  precision). The entry ``output`` also names the model's head under its own name (``head``:
  its parallel plan's, ``lm_head`` in the hf family);
* never one whose dimensions are not multiples of 16 (float8 GEMM kernels require it);
* with ``auto_filter_small_kn``, not those too small for float8 to pay for its casts (torchao's
  recipe-specific thresholds, measured on H100);
* never one inside a module that declares ``float8_exempt = True``: the Mixture-of-Experts
  layer (docs/moe.md) keeps its router, routed experts and shared experts in high precision.

Recipes (``recipe_name``): ``tensorwise`` (one scale per tensor; supports float8 all-gather of
FSDP parameters and the one-all-reduce scale precompute) and ``rowwise`` (one scale per row,
power-of-2 scales; more accurate, no float8 all-gather).

Where float8 can run: CUDA GPUs with compute capability >= 8.9 (Ada, Hopper, Blackwell) use
the float8 tensor-core GEMMs. Elsewhere ``float8_unsupported_reason`` says why, and ``emulate``
runs the same numerics (operands rounded to float8 with the same scales) with high-precision
matmuls: correctness checks on older GPUs, no speed-up.

On CPU float8 is always emulated. torch 2.13's CPU ``torch._scaled_mm`` is correct but, with
per-tensor (0-d) scales, runs a reference kernel: measured ~0.01 GFLOP/s for a 256^3 float8
matmul on one thread, about 5,000x slower than the fp32 matmul. Only row-wise scales take the
oneDNN path, and torchao's rowwise recipe itself calls the per-tensor form in backward (it
moves the row scales out of the GEMM). One debug-model step would take minutes, so CPU runs
use torchao's emulation, which rounds the operands exactly as the float8 GEMM would.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from torchtitan.tools.logging import logger
from torchtitan.tools.torch_compat import torchao_unusable_reason

__all__ = [
    "apply_float8",
    "float8_module_filter",
    "float8_tp_styles",
    "float8_unsupported_reason",
    "register_float8_precompute_hook",
]


def float8_unsupported_reason(device_type: str, emulate: bool = False) -> str | None:
    """None when float8 training can run on ``device_type``; else the reason, in words."""
    if not hasattr(torch, "float8_e4m3fn") or not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no float8 dtypes / torch._scaled_mm"
    reason = torchao_unusable_reason()
    if reason is not None:
        return reason
    try:
        import torchao.float8  # noqa: F401
    except Exception as e:  # noqa: BLE001 - reported as the reason, never hidden
        return f"torchao does not import with torch {torch.__version__}: {type(e).__name__}: {e}"
    if emulate or device_type == "cpu":  # CPU: always emulated (module docstring)
        return None
    if device_type == "cuda":
        if not torch.cuda.is_available():
            return "CUDA is not available"
        major, minor = torch.cuda.get_device_capability()
        if (major, minor) < (8, 9):
            name = torch.cuda.get_device_name()
            return (
                f"{name} has compute capability {major}.{minor}; float8 matmuls need >= 8.9 "
                "(Ada, Hopper or newer)"
            )
        return None
    return f"float8 training is not implemented for device type {device_type!r}"


def float8_module_filter(
    filter_fqns: Iterable[str], recipe_name: str, auto_filter_small_kn: bool
) -> Callable[[nn.Module, str], bool]:
    """``(module, fqn) -> convert?`` for ``convert_to_float8_training``."""
    filter_fqns = list(filter_fqns)
    if auto_filter_small_kn:
        # torchao's thresholds for "too small to gain" per recipe; it also applies filter_fqns
        # and the multiple-of-16 rule.
        from torchao.float8 import _auto_filter_for_recipe

        return _auto_filter_for_recipe(recipe_name, filter_fqns)

    def keep(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear) or any(f in fqn for f in filter_fqns):
            return False
        out_features, in_features = module.weight.shape
        return out_features % 16 == 0 and in_features % 16 == 0

    return keep


def apply_float8(
    model: nn.Module,
    *,
    recipe_name: str = "tensorwise",
    filter_fqns: Iterable[str] = ("output",),
    auto_filter_small_kn: bool = True,
    enable_fsdp_float8_all_gather: bool = False,
    emulate: bool = False,
    device_type: str = "cuda",
    head: str = "output",
) -> list[str]:
    """Swap eligible linears of ``model`` (on meta) for torchao ``Float8Linear`` in place.

    ``device_type`` is where the model will run: on ``cpu`` the matmuls are always emulated.
    ``head`` is the output projection's path (``ModelParallelPlan.head``): the ``filter_fqns``
    entry ``output`` keeps it in high precision too.
    Returns the names of the converted modules (empty when the filters left none: a warning
    then says why float8 will have no effect).
    """
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    if enable_fsdp_float8_all_gather and recipe_name != "tensorwise":
        raise ValueError("float8 all-gather of FSDP parameters needs the tensorwise recipe")
    reason = float8_unsupported_reason(device_type, emulate)
    if reason is not None:
        raise RuntimeError(f"float8 training cannot run here: {reason}")
    if device_type == "cpu" and not emulate:
        logger.info(
            "float8 on CPU: emulated (torch's CPU float8 GEMM with per-tensor scales is a slow "
            "reference kernel; see docs/float8.md)"
        )
        emulate = True
    config = Float8LinearConfig.from_recipe_name(recipe_name)
    # The recipe fixes the scaling; these two options are per run (frozen dataclass: replace).
    config = dataclasses.replace(
        config, enable_fsdp_float8_all_gather=enable_fsdp_float8_all_gather, emulate=emulate
    )
    filter_fqns = list(filter_fqns)
    if "output" in filter_fqns and head not in filter_fqns:
        filter_fqns.append(head)
    keep = float8_module_filter(filter_fqns, recipe_name, auto_filter_small_kn)
    exempt = [f"{n}." for n, m in model.named_modules() if getattr(m, "float8_exempt", False)]
    converted: list[str] = []

    def record(module: nn.Module, fqn: str) -> bool:
        ok = not fqn.startswith(tuple(exempt)) and bool(keep(module, fqn))
        if ok:
            converted.append(fqn)
        return ok

    convert_to_float8_training(model, module_filter_fn=record, config=config)
    if converted:
        logger.info(
            f"float8 {recipe_name}: converted {len(converted)} linear layers"
            f"{' (emulated)' if emulate else ''}"
            f"{', FSDP float8 all-gather' if enable_fsdp_float8_all_gather else ''}"
        )
    else:
        logger.warning(
            "float8 is enabled but no linear layer was converted: every one is excluded by "
            f"filter_fqns={list(filter_fqns)} or is too small (auto_filter_small_kn="
            f"{auto_filter_small_kn}); set --no-quantize.dense.float8.auto_filter_small_kn to "
            "convert small layers"
        )
    return converted


def register_float8_precompute_hook(
    optimizer: torch.optim.Optimizer, model_parts: list[nn.Module]
) -> Any:
    """After every ``optimizer.step()``, compute the float8 scales of all FSDP-sharded weights
    in one all-reduce (torchao ``precompute_float8_dynamic_scale_for_fsdp``), instead of one
    small all-reduce per weight at its all-gather. Tensorwise recipe with float8 all-gather
    only. Returns the hook handle.
    """
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for part in model_parts:
            precompute_float8_dynamic_scale_for_fsdp(part)

    return optimizer.register_step_post_hook(hook)


def float8_tp_styles() -> tuple[type, type, type]:
    """(ColwiseParallel, RowwiseParallel, PrepareModuleInput) variants from torchao that
    all-gather / reduce-scatter activations in float8: for the tensor-parallel plan of a model
    whose linears were converted with the tensorwise recipe."""
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    return Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput
