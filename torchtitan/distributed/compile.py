"""torch.compile per transformer block (fullgraph, except blocks that declare graph breaks: the
MoE layer's, docs/moe.md) and of the loss.

Why per block and not the whole model: every block has the same code and shapes, so dynamo
compiles one graph and reuses it for all blocks (compile time independent of depth), FSDP2's
per-block hooks stay outside the compiled code (each block's parameters are all-gathered by
FSDP, then the compiled forward runs on plain local tensors), and pipeline stages, which hold
a subset of the blocks, compile the same way.

The block's ``forward`` is replaced by its compiled version instead of wrapping the module in
``torch.compile(module)``: the module tree and parameter names stay unchanged (no ``_orig_mod.``
segment), so checkpoints and weight maps do not depend on whether compile was on.

Compile caches. Inductor writes compiled kernels and the FX-graph / AOTAutograd caches under
``TORCHINDUCTOR_CACHE_DIR`` (default ``/tmp/torchinductor_<user>``), and a later run with the
same model, shapes and torch version loads them instead of recompiling (first compile of a
debug-model block on a 2-core CPU: ~16 s; warm: < 1 s). ``set_compile_cache_dir`` points that
folder somewhere persistent (``compile.cache_dir``).

One folder per tensor/context-parallel coordinate. Under tensor parallel, ranks trace graphs
that differ only in constants baked in from their mesh coordinate: the loss-parallel
cross-entropy compares labels with this rank's vocabulary range (``labels >= 0``/``< 1024`` on
tp rank 0, ``>= 1024``/``< 2048`` on tp rank 1). torch 2.13's AOTAutograd cache keys the graph
before DTensor is lowered, so both ranks get the same key, and on a warm cache a rank can load
the other's graph: training then runs with silently wrong losses (measured: step-1 loss 13.1
instead of 8.1 on TP 2). ``set_compile_cache_dir(..., rank_subdir="tp1_cp0")`` gives every
such coordinate its own folder; data-parallel ranks (identical graphs) still share one.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.tensor import DTensor

from torchtitan.tools.logging import logger

__all__ = [
    "apply_compile",
    "compile_loss",
    "set_compile_cache_dir",
]

F = TypeVar("F", bound=Callable[..., Any])


def set_compile_cache_dir(
    cache_dir: str | None, base_folder: str = ".", rank_subdir: str | None = None
) -> str:
    """Use ``cache_dir`` for inductor's caches (None/empty: keep ``$TORCHINDUCTOR_CACHE_DIR`` or
    inductor's default); a relative ``cache_dir`` is taken under ``base_folder``.
    ``rank_subdir``: a subfolder for ranks whose graphs embed their mesh coordinate (see the
    module docstring), e.g. ``tp1_cp0``.

    Returns the folder in use. Must run before the first compilation; inductor reads
    ``TORCHINDUCTOR_CACHE_DIR`` whenever it needs the folder.
    """
    from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir

    if cache_dir:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(
            Path(base_folder, Path(cache_dir).expanduser()).resolve()
        )
    current = Path(inductor_cache_dir())
    if rank_subdir and current.name != rank_subdir:  # (idempotent)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(current / rank_subdir)
    return inductor_cache_dir()  # creates the folder


def _wait_embedding_hook(module: nn.Module, args: Any, output: Any) -> Any:
    """Forward hook: finish the embedding's pending collective before the first block.

    Under tensor + sequence parallel the embedding's output comes out of a reduce-scatter as a
    DTensor whose local tensor is an ``AsyncCollectiveTensor`` (the wait is deferred until first
    use). When that first use is inside a compiled block, the wait ends up inside the compiled
    graph and its backward fails on torch 2.13 (pytorch#184980). Waiting here, in eager code,
    gives the compiled block an ordinary tensor. It costs nothing: the block needs the value
    right away anyway.
    """
    import torch.distributed._functional_collectives as funcol

    if isinstance(output, DTensor):
        if isinstance(output._local_tensor, funcol.AsyncCollectiveTensor):
            # to_local / from_local are differentiable, so gradients reach the embedding.
            waited = funcol.wait_tensor(output.to_local())
            return DTensor.from_local(
                waited,
                output.device_mesh,
                output.placements,
                run_check=False,
                shape=output.shape,
                stride=output.stride(),
            )
        return output
    if isinstance(output, funcol.AsyncCollectiveTensor):
        return funcol.wait_tensor(output)
    return output


def _may_break_graph(block: nn.Module) -> bool:
    """A block holding a module with ``compile_graph_breaks = True`` (the MoE layer: its routed
    experts may run eagerly, docs/moe.md) is compiled with ``fullgraph=False``."""
    return any(getattr(m, "compile_graph_breaks", False) for m in block.modules())


def apply_compile(
    layers: nn.ModuleDict | nn.ModuleList,
    *,
    backend: str = "inductor",
    fullgraph: bool = True,
    wait_on: nn.Module | None = None,
    inside_checkpoint: bool = False,
) -> int:
    """Compile the forward of every block in ``layers`` (a dict or list of blocks) in place;
    returns the count.

    Apply after activation checkpointing (the recompute is then compiled too) and before
    FSDP/DDP (their hooks stay outside the compiled forward). ``fullgraph`` holds for every
    block except those that declare graph breaks (``_may_break_graph``). ``wait_on``: the token
    embedding under tensor parallel, whose async output must be waited on before a compiled
    block (see ``_wait_embedding_hook``). ``inside_checkpoint`` (set under tensor parallel):
    a checkpoint-wrapped block's inner module is compiled and the checkpoint stays eager around
    it; compiling the wrapper with DTensor blocks stops AOTAutograd on a ``DeviceMesh`` among
    the saved values (torch 2.13; docs/parallelisms.md, "Known limits").
    """
    for block in layers.values() if isinstance(layers, nn.ModuleDict) else layers:
        # An instance attribute shadows the class's forward; nn.Module.__call__ runs the
        # module's hooks (FSDP's unshard/reshard) around it, outside the compiled region.
        full = fullgraph and not _may_break_graph(block)
        if inside_checkpoint and isinstance(block, CheckpointWrapper):
            block = block._checkpoint_wrapped_module  # the checkpoint stays eager around it
        block.forward = torch.compile(block.forward, backend=backend, fullgraph=full)  # type: ignore[method-assign]
    if wait_on is not None:
        wait_on.register_forward_hook(_wait_embedding_hook)
    logger.info(f"compiled {len(layers)} blocks (backend {backend}, fullgraph {fullgraph})")
    return len(layers)


def compile_loss(loss_fn: F, *, backend: str = "inductor") -> F:
    """The loss function compiled (fuses the fp32 upcast, log-softmax and the mean)."""
    return torch.compile(loss_fn, backend=backend, fullgraph=True)  # type: ignore[return-value]
