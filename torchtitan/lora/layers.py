"""The adapter modules (docs/lora.md): :class:`LoRALinear`, an ``nn.Linear`` whose frozen
``weight`` keeps its name (so TP/FSDP plans and checkpoints that name ``<module>.weight`` are
unchanged) plus ``lora_A [r, in]`` and ``lora_B [out, r]``; and :class:`LoRAExperts`, stacked MoE
experts of any family (``models/common/moe_experts.py: StackedExperts``) with per-expert stacks
``lora_A_<w> [E, in, r]`` / ``lora_B_<w> [E, r, out]`` (our experts multiply rows by ``w[e]``, no
transpose). The output is
``base(x) + scaling * B(A(dropout(x)))`` with ``scaling = alpha / r`` (``alpha / sqrt(r)``:
rsLoRA); adapters stay fp32 whatever the base's dtype.
"""

from __future__ import annotations

import copy
import math
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from torchtitan.distributed.float8_grouped import PaddedGroups
from torchtitan.models.common.moe_experts import StackedExperts, expert_matmul, local_weight
from torchtitan.tools.torch_compat import torchao_nf4

__all__ = [
    "ADAPTER_PREFIX",
    "LoRAExperts",
    "LoRALinear",
    "adapt_experts",
    "is_adapter_name",
    "lora_scaling",
]

ADAPTER_PREFIX = "lora_"


def is_adapter_name(fqn: str) -> bool:
    """Whether a parameter name (full or local) is an adapter's."""
    return fqn.rsplit(".", 1)[-1].startswith(ADAPTER_PREFIX)


def lora_scaling(rank: int, alpha: float, rslora: bool) -> float:
    return alpha / math.sqrt(rank) if rslora else alpha / rank


def _dropout(p: float) -> nn.Module:
    return nn.Dropout(p) if p > 0 else nn.Identity()


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` for a plain weight or a torchao NF4 one (QLoRA: dequantized per call)."""
    if type(w).__name__ == "NF4Tensor" or type(getattr(w, "data", None)).__name__ == "NF4Tensor":
        return torchao_nf4().linear_nf4(x, w)
    return F.linear(x, w)


class LoRALinear(nn.Linear):
    """A frozen linear projection (its bias, where it has one, frozen too: GPT-OSS's attention)
    plus a trainable low-rank update."""

    lora_A: nn.Parameter
    lora_B: nn.Parameter
    lora_dropout: nn.Module
    rank: int
    scaling: float

    def __init__(self, base: nn.Linear, rank: int, scaling: float, dropout: float) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias  # None or the base's (frozen with it)
        device = base.weight.device
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, device=device))
        self.lora_B = nn.Parameter(torch.empty(self.out_features, rank, device=device))
        self.rank, self.scaling = rank, scaling
        self.lora_dropout = _dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._compute(x, self.weight, self.bias, self.lora_A, self.lora_B)

    def local_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The forward on this rank's local values (replicated DTensors computed locally;
        ``models/common/moe_experts.py: local_linear``)."""
        bias = None if self.bias is None else local_weight(self.bias)
        w, a, b = (local_weight(p) for p in (self.weight, self.lora_A, self.lora_B))
        return self._compute(x, w, bias, a, b)

    def _compute(
        self, x: torch.Tensor, w: Any, bias: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor
    ) -> torch.Tensor:
        base = _linear(x, w) if bias is None else _linear(x, w) + bias
        delta = F.linear(F.linear(self.lora_dropout(x).to(a.dtype), a), b)
        return base + (delta * self.scaling).to(base.dtype)

    def adapt_parallel_style(self, style: ParallelStyle) -> ParallelStyle:
        """The TP style for this module (``distributed/tensor_parallel.py``): a colwise
        projection gets ``B`` colwise and ``A`` replicated, a rowwise one ``A`` rowwise and ``B``
        replicated; the input/output layouts are the original style's."""
        if isinstance(style, ColwiseParallel):
            layout = {
                "weight": Shard(0),
                "bias": Shard(0),
                "lora_A": Replicate(),
                "lora_B": Shard(0),
            }
        elif isinstance(style, RowwiseParallel):
            layout = {
                "weight": Shard(1),
                "bias": Replicate(),
                "lora_A": Shard(1),
                "lora_B": Replicate(),
            }
        else:
            return style
        adapted = copy.copy(style)
        adapted._partition_linear_fn = partial(_partition, layout)  # type: ignore[method-assign]
        return adapted


def _partition(layout: dict[str, Any], name: str, module: nn.Module, mesh: Any) -> None:
    """Distribute this module's own parameters by ``layout``, keeping ``requires_grad``."""
    for pname, p in list(module.named_parameters(recurse=False)):
        if isinstance(p, DTensor):
            continue
        dt = distribute_tensor(p.data, mesh, [layout[pname]])
        module.register_parameter(pname, nn.Parameter(dt, p.requires_grad))


class LoRAExperts(StackedExperts):
    """Per-expert adapters on stacked experts of any family (the shared ``Experts``, GPT-OSS's
    biased ones, ...): a mixin over the experts' own class that overrides the
    :class:`StackedExperts` hook ``project``, adding ``scaling * (x A[e]) B[e]`` to each adapted
    projection's product (before the family adds its biases). Made by :func:`adapt_experts`."""

    adapted: tuple[str, ...]
    rank: int
    scaling: float
    lora_dropout: nn.Module

    def project(
        self, x: torch.Tensor, name: str, counts: torch.Tensor | PaddedGroups, grouped: bool
    ):
        y = super().project(x, name, counts, grouped)
        if name not in self.adapted:
            return y
        g = self.grad_scale  # expert parallel: 1 / ep on the way to every expert weight
        a = local_weight(getattr(self, f"lora_A_{name}"), g)
        b = local_weight(getattr(self, f"lora_B_{name}"), g)
        # A float8 base in its padded layout: the adapters run on the real rows (padding rows
        # would change the dropout's draws) and their product is added at those rows.
        padded = counts if isinstance(counts, PaddedGroups) else None
        rows, n = (x[padded.where], padded.counts) if padded is not None else (x, counts)
        assert isinstance(n, torch.Tensor)
        h = expert_matmul(self.lora_dropout(rows).to(a.dtype), a, n, grouped)
        delta = (expert_matmul(h, b, n, grouped) * self.scaling).to(y.dtype)
        return y + delta if padded is None else y.index_add(0, padded.where, delta)

    def _grouped(self, x: torch.Tensor) -> bool:
        if not super()._grouped(x):
            return False
        # grouped_mm needs 16-byte row strides: the rank must allow it too.
        return self.use_grouped_mm is not None or (self.rank * 4) % 16 == 0


_CLASSES: dict[type, type] = {}


def _lora_class(cls: type) -> type:
    """``LoRA<cls>``: :class:`LoRAExperts` over ``cls`` (one per class, importable by name)."""
    if issubclass(cls, LoRAExperts):
        raise ValueError(f"{cls.__name__} already carries adapters")
    if cls not in _CLASSES:
        name = f"LoRA{cls.__name__}"
        _CLASSES[cls] = type(name, (LoRAExperts, cls), {"__module__": __name__})
        _CLASSES[cls].__qualname__ = name
        globals().setdefault(name, _CLASSES[cls])
    return _CLASSES[cls]


def adapt_experts(
    module: StackedExperts, adapted: tuple[str, ...], rank: int, scaling: float, dropout: float
) -> LoRAExperts:
    """Give ``module`` (in place: its weights keep their names) per-expert stacks
    ``lora_A_<w> [E, in, r]`` and ``lora_B_<w> [E, r, out]`` for every projection in ``adapted``."""
    unknown = [n for n in adapted if n not in module.projections]
    if unknown:
        raise ValueError(f"{type(module).__name__} has no stacked projection {unknown}")
    module.__class__ = _lora_class(type(module))
    assert isinstance(module, LoRAExperts)
    module.adapted, module.rank, module.scaling = adapted, rank, scaling
    for name in adapted:
        n, d_in, d_out = getattr(module, name).shape
        device = getattr(module, name).device
        a = torch.empty(n, d_in, rank, device=device)
        module.register_parameter(f"lora_A_{name}", nn.Parameter(a))
        module.register_parameter(f"lora_B_{name}", nn.Parameter(a.new_empty(n, rank, d_out)))
    module.lora_dropout = _dropout(dropout)
    return module
