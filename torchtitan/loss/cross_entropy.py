"""Token-level cross-entropy (computed in fp32 whatever the logits' dtype) and the global
token normalisation of the training loss (docs/sft.md, "Loss normalisation").

The trainer's loss is a SUM over the tokens whose label is not ``IGNORE_INDEX``, multiplied by
:func:`global_loss_scale` of the step: ``grad_avg_ranks / (unmasked tokens of the global
batch)``. The token count covers every microbatch of the step (gradient accumulation and pipeline
microbatches) on every data-parallel rank, so every unmasked token of the global batch weighs the
same whatever the layout; ``grad_avg_ranks`` undoes the averaging of gradients (FSDP/DDP) and of
the logged loss over the data and context-parallel ranks. Without masked labels this is the
plain mean over the global batch, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.config.sections import Compile
from torchtitan.distributed.compile import compile_loss, set_compile_cache_dir
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.utils import all_reduce_
from torchtitan.tools.logging import logger

IGNORE_INDEX = -100
"""Label of a token that does not count (prompt tokens under SFT, padding)."""


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the unmasked tokens of the (micro)batch; logits [B, S, V],
    labels [B, S]."""
    return F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=IGNORE_INDEX
    )


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over the unmasked tokens (label != ``IGNORE_INDEX``); the trainer
    scales it by :func:`global_loss_scale`."""
    return F.cross_entropy(
        logits.flatten(0, 1).float(),
        labels.flatten(0, 1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def unmasked_tokens(labels: Sequence[torch.Tensor], dp_mesh: DeviceMesh | None) -> torch.Tensor:
    """Tokens with a label (!= ``IGNORE_INDEX``) in ``labels`` (this rank's microbatches of one
    step, whole sequences: before context parallel shards them), summed over ``dp_mesh``: an
    int64 scalar on the labels' device (no host sync: the step's loss scale stays on device)."""
    count = torch.zeros((), dtype=torch.int64, device=labels[0].device)
    for lab in labels:
        count += (lab != IGNORE_INDEX).sum()
    if dp_mesh is not None and dp_mesh.size() > 1:
        all_reduce_(count, dp_mesh, op="sum")
    return count


def global_loss_scale(global_tokens: torch.Tensor | int, grad_avg_ranks: int) -> torch.Tensor:
    """Factor turning a rank's summed token loss into its share of the global-batch mean:
    ``grad_avg_ranks / global_tokens`` (fp32, on the count's device), where ``grad_avg_ranks``
    is the number of ranks whose gradients (and logged losses) are averaged. A step without any
    unmasked token gets 0 (no gradient) rather than a division by zero."""
    tokens = torch.as_tensor(global_tokens).to(torch.float32)
    return torch.where(tokens > 0, grad_avg_ranks / tokens.clamp(min=1), 0.0)


def build_loss_fn(
    compile_cfg: Compile, dump_folder: str, dims: ParallelDims
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Summed token cross-entropy, compiled (lazily, at its first call) when ``compile`` lists
    the loss; the step's ``loss_scale`` makes it the global-batch mean (docs/sft.md)."""
    if not compile_cfg.enable:
        return cross_entropy_sum
    # Ranks at different TP/CP coordinates compile different graphs: separate caches.
    coords = dims.coordinates()
    cache = set_compile_cache_dir(
        compile_cfg.cache_dir,
        base_folder=dump_folder,
        rank_subdir=f"tp{coords['tp']}_cp{coords['cp']}"
        if dims.tp_enabled or dims.cp_enabled
        else None,
    )
    logger.info(f"compile cache: {cache}")
    if "loss" in compile_cfg.components:
        return compile_loss(cross_entropy_sum, backend=compile_cfg.backend)
    return cross_entropy_sum
