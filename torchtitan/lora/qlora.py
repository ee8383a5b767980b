"""QLoRA (docs/lora.md, "QLoRA"): the frozen projections that carry adapters are stored in NF4
(torchao's ``NF4Tensor``: 4-bit normal-float codes in blocks of 64 values with double-quantized
block scales, about 0.52 bytes per value) and dequantized to the input's dtype per matmul
(``torchao``'s ``linear_nf4``: bf16 compute under bf16 training, fp32 on CPU tests).

Quantization runs once the base weights are final: after the initial load (Hugging Face or
checkpoint), because checkpoints hold only the adapters and the base is reloaded from its source
on resume. Under FSDP2 each weight is gathered and quantized whole, then sharded by rows: every
rank holds its block of the codes and scales, equal to the one-process NF4, and FSDP all-gathers
the NF4 pieces (torchao's ``fsdp_pre_all_gather``/``fsdp_post_all_gather``). Tensor parallel
(NF4 inside a TP DTensor) is refused by preflight.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from torchtitan.lora.layers import LoRALinear
from torchtitan.tools.torch_compat import torchao_nf4

__all__ = ["nf4_problem", "nf4_shard_problem", "quantize_base"]

BLOCK = 64


def _scaler_block(numel: int) -> int:
    """The largest scaler block (at most torchao's default, 256) dividing the block count."""
    blocks, size = numel // BLOCK, 256
    while size > 1 and blocks % size:
        size //= 2
    return size


def nf4_problem(shape: tuple[int, ...]) -> str | None:
    """Why a weight of ``shape`` cannot be stored in NF4, or None."""
    numel = 1
    for s in shape:
        numel *= s
    if numel % BLOCK:
        return f"a weight of shape {list(shape)} has {numel} values, not a multiple of {BLOCK}"
    return None


def nf4_shard_problem(shape: tuple[int, ...], shards: int) -> str | None:
    """Why a weight of ``shape`` cannot be held in NF4 as ``shards`` equal row blocks (FSDP's
    ``Shard(0)``; each rank's codes, block scales and scale groups whole), or None."""
    problem = nf4_problem(shape)
    if problem is not None or shards == 1:
        return problem
    numel = 1
    for s in shape:
        numel *= s
    groups = numel // BLOCK // _scaler_block(numel)
    if shape[0] % shards or groups % shards:
        return (
            f"a weight of shape {list(shape)} ({groups} NF4 scale groups) does not split into "
            f"{shards} equal row blocks of whole scale groups"
        )
    return None


def _fsdp_params(parts: list[nn.Module]) -> dict[int, Any]:
    """FSDP2's record of every sharded ``weight``, by the id of the module holding it."""
    found: dict[int, Any] = {}
    for part in parts:
        for module in part.modules():
            state = getattr(module, "_get_fsdp_state", None)
            group = getattr(state(), "_fsdp_param_group", None) if callable(state) else None
            for fp in getattr(group, "fsdp_params", []):
                if fp._module_info.param_name == "weight":
                    found[id(fp._module_info.module)] = fp
    return found


def _sharded_nf4(nf4: Any, like: DTensor) -> DTensor:
    """This rank's row block of the whole weight's NF4 form, as a DTensor placed like ``like``
    (the rows, codes and block scales of every rank concatenate to the unsharded NF4)."""
    if like.device_mesh.ndim != 1 or like.placements != (Shard(0),):
        raise ValueError(f"lora.quantize_base nf4: a weight placed {like.placements} (FSDP only)")
    mesh = like.device_mesh
    rows = like.shape[0] // mesh.size()
    local = torch.split(nf4, rows)[mesh.get_local_rank()]
    return DTensor.from_local(
        local, mesh, [Shard(0)], run_check=False, shape=like.shape, stride=like.stride()
    )


def _adopt(fsdp_param: Any, value: DTensor) -> None:
    """Point FSDP2's record at the NF4 shard (its ``reset_sharded_param``, the path of
    ``load_state_dict(assign=True)``), then let it find the subclass's all-gather extension."""
    fsdp_param._sharded_param_data = value.to_local().view(-1)  # skips a plain-storage check
    fsdp_param.reset_sharded_param()
    fsdp_param._init_extensions()


@torch.no_grad()
def quantize_base(parts: list[nn.Module], dtype: torch.dtype = torch.bfloat16) -> tuple[int, int]:
    """Replace every adapted projection's frozen weight with its NF4 form (from ``dtype``);
    returns (bytes before, bytes after) of those weights on this rank. An FSDP-sharded weight
    is gathered and quantized whole, then each rank keeps its row block (the same codes and
    scales as one process) and FSDP gathers the NF4 pieces (torchao's all-gather extension)."""
    to_nf4 = torchao_nf4().to_nf4

    fsdp = _fsdp_params(parts)
    before = after = 0
    for part in parts:
        for module in part.modules():
            if not isinstance(module, LoRALinear):
                continue
            w = module.weight
            full = w.full_tensor() if isinstance(w, DTensor) else w.detach()
            shards = w.device_mesh.size() if isinstance(w, DTensor) else 1
            problem = nf4_shard_problem(tuple(full.shape), shards)
            if problem is not None:
                raise ValueError(f"lora.quantize_base nf4: {problem}")
            nf4 = to_nf4(full.to(dtype), BLOCK, _scaler_block(full.numel()))
            before += full.numel() * full.element_size() // shards
            inner = (nf4.quantized_data, nf4.quantized_scalers, nf4.quantization_factor)
            after += sum(t.numel() * t.element_size() for t in inner) // shards
            after += sum(t.numel() * t.element_size() for t in (nf4.scaler_mean, nf4.nf4))
            value = _sharded_nf4(nf4, w) if isinstance(w, DTensor) else nf4
            module.weight = nn.Parameter(value, requires_grad=False)
            if id(module) in fsdp:
                _adopt(fsdp[id(module)], value)
    return before, after
