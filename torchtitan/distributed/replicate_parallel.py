"""A tensor-parallel style for modules that run whole on every TP rank (docs/parallelisms.md,
"Expert parallel"): Mixture-of-Experts layers, whose experts are split by expert parallel, not
by tensor parallel.

``ReplicateParallel(sequence_dim)``: every parameter of the module that is not already a DTensor
(expert-parallel experts are) becomes a replicated DTensor on ``tp``, so all parameters are
DTensors (foreach optimizers and norm kernels refuse a mix). The module's input, the
sequence-sharded residual stream, is all-gathered and handed over as a plain tensor; the module
computes with the local values of its weights (``DTensor.to_local``, gradient placements
replicated: every TP rank computes the same gradient from the same tokens); its output becomes
a replicated DTensor again and is cut back to this rank's sequence shard.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["ReplicateParallel", "ReplicateWeights", "replicate_params"]


def replicate_params(module: nn.Module, device_mesh: DeviceMesh) -> None:
    """Every parameter of ``module`` that is not a DTensor yet becomes a replicated DTensor."""
    for sub in module.modules():
        for name, p in list(sub.named_parameters(recurse=False)):
            if not isinstance(p, DTensor):
                replicated = distribute_tensor(p.data, device_mesh, [Replicate()])
                sub.register_parameter(name, nn.Parameter(replicated, p.requires_grad))


class ReplicateWeights(ParallelStyle):
    """A module that runs whole on every TP rank on plain (not sequence-sharded) inputs and
    computes with the local values of its weights (a vision tower, docs/vlm.md): its parameters
    become replicated DTensors on ``tp`` (so every parameter of the model is a DTensor); its
    inputs and outputs are left alone. Every TP rank must feed it the same inputs, so it
    computes the same gradients (left replicated, not summed)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        replicate_params(module, device_mesh)
        return module


class ReplicateParallel(ParallelStyle):
    def __init__(self, sequence_dim: int = 1) -> None:
        super().__init__()
        self.sequence_dim = sequence_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        replicate_params(module, device_mesh)
        seq = self.sequence_dim

        def gather(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            x = args[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, [Shard(seq)], run_check=False)
            return (x.redistribute(device_mesh, [Replicate()]).to_local(), *args[1:])

        def shard(_: nn.Module, __: Any, out: Any) -> DTensor:
            full = DTensor.from_local(out, device_mesh, [Replicate()], run_check=False)
            return full.redistribute(device_mesh, [Shard(seq)])

        module.register_forward_pre_hook(gather)
        module.register_forward_hook(shard)
        return module
