"""Activation checkpointing (AC): trade recomputation in backward for activation memory.

Three modes, all built on torch's non-reentrant ``torch.utils.checkpoint`` through
``checkpoint_wrapper`` (which keeps parameter names loadable: the wrapper segment
``_checkpoint_wrapped_module.`` is removed from state-dict keys by torch's own hooks):

* ``full``: every transformer block keeps only its input; the whole block is recomputed in
  backward. Least memory, about one extra forward of compute.
* ``selective`` with an integer N (``selective_ac_option = "N"``): blocks whose layer id + 1 is a
  multiple of N are fully checkpointed, the others keep all activations. The layer id is the
  block's key in ``model.layers``, so the same blocks are checkpointed whatever the pipeline
  split.
* ``selective`` with ``op``: every block is checkpointed with a per-op policy
  (``torch.utils.checkpoint.create_selective_checkpoint_contexts``): the outputs of expensive ops
  are saved (attention, tensor-parallel reduce-scatters, expert-parallel all-to-alls of the token
  rows, float8 amax reductions, and every second matmul), everything else (norms, RoPE, SwiGLU,
  residual adds and the other matmuls) is recomputed. Memory between none and full at a
  fraction of full's recompute.

Recomputation replays the same kernels on the same inputs, so gradients are identical to
training without AC (tests/unit/test_activation_checkpoint.py checks it bitwise on CPU).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointWrapper,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from torchtitan.tools.logging import logger

__all__ = ["apply_ac", "parse_selective_option", "op_sac_policy"]

_aten = torch.ops.aten


def _ops(*names: tuple[Any, str]) -> set[Any]:
    """The overloads that exist in this build (some attention kernels are device-specific)."""
    found = set()
    for namespace, name in names:
        packet = getattr(namespace, name, None)
        if packet is not None:
            found.add(packet.default)
    return found


# Outputs always saved under op-level AC: expensive to recompute, or communication.
_ALWAYS_SAVE = _ops(
    (_aten, "_scaled_dot_product_flash_attention"),
    (_aten, "_scaled_dot_product_efficient_attention"),
    (_aten, "_scaled_dot_product_cudnn_attention"),
    (_aten, "_scaled_dot_product_flash_attention_for_cpu"),
    (torch.ops._c10d_functional, "reduce_scatter_tensor"),  # TP + SP: no comm in recompute
    (torch.ops._c10d_functional, "all_to_all_single"),  # expert parallel's token rows
    # Float8's dynamic scales come from amax reductions over whole tensors: tiny to keep, a
    # full pass over the input to recompute.
    (_aten, "max"),
    (_aten, "amax"),
)
# Matmuls: every second one is saved, the others recomputed.
_MATMULS = _ops((_aten, "mm"), (_aten, "addmm"), (_aten, "bmm"), (_aten, "_scaled_mm"))


def parse_selective_option(option: str) -> int | str:
    """``"op"`` or a positive integer (as text). Raises ValueError otherwise (validate_config
    turns that into a ConfigError before anything runs)."""
    text = option.strip().lower()
    if text == "op":
        return "op"
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise ValueError(f"selective_ac_option must be 'op' or an integer >= 1, got {option!r}")


def op_sac_policy() -> Callable[..., CheckpointPolicy]:
    """A fresh op-level policy: save attention/comm/amax outputs and every second matmul.

    The matmul counters are per pass (forward vs recompute), so both passes make the same
    decision for the same matmul; a new policy (new counters) is made for every block call.
    """
    matmul_count = {False: 0, True: 0}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op in _ALWAYS_SAVE:
            return CheckpointPolicy.MUST_SAVE
        if op in _MATMULS:
            matmul_count[ctx.is_recompute] += 1
            if matmul_count[ctx.is_recompute] % 2 == 1:
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _op_sac_contexts() -> Any:
    return create_selective_checkpoint_contexts(op_sac_policy())


def _wrap_block(block: nn.Module, op_level: bool) -> CheckpointWrapper:
    # preserve_rng_state=False: the Llama blocks draw no random numbers in forward, and saving
    # and restoring the RNG state for every block would cost time for nothing.
    kwargs: dict[str, Any] = {"preserve_rng_state": False}
    if op_level:
        kwargs["context_fn"] = _op_sac_contexts
    return checkpoint_wrapper(block, **kwargs)  # type: ignore[return-value]


def apply_ac(
    layers: nn.ModuleDict | nn.ModuleList, mode: str, selective_option: str = "op"
) -> list[str]:
    """Wrap the blocks in ``layers`` (the model's ``nn.ModuleDict`` of blocks, keyed by block
    id, or an ``nn.ModuleList``: keys ``"0"``, ``"1"``...) in place.

    ``mode``: ``none``, ``full`` or ``selective`` (then ``selective_option`` is ``op`` or an
    integer N as text). Returns the keys of the wrapped blocks.
    """
    if mode == "none":
        return []
    if mode not in ("full", "selective"):
        raise ValueError(f"unknown activation checkpoint mode {mode!r}")
    option = parse_selective_option(selective_option) if mode == "selective" else None
    wrapped = []
    items: list[tuple[int | str, nn.Module]] = (
        list(enumerate(layers)) if isinstance(layers, nn.ModuleList) else list(layers.items())
    )
    for index, block in items:
        key = str(index)
        if isinstance(block, CheckpointWrapper):
            raise RuntimeError(f"block {key} is already activation-checkpointed")
        if isinstance(option, int) and (int(key) + 1) % option != 0:
            continue
        layers[index] = _wrap_block(block, op_level=option == "op")  # type: ignore[index]
        wrapped.append(key)
    what = mode if option is None else f"selective ({option})"
    logger.info(f"activation checkpointing {what}: {len(wrapped)}/{len(layers)} blocks")
    return wrapped
