"""What replica fault tolerance adds to a rank's memory (docs/fault_tolerance.md, "Memory and
traffic"), for the planner's per-rank estimate (planner/rank_memory.py) and ``--job.explain``.

- every mode: a recovering rank receives its peer's model and optimizer state (host memory,
  torchft's HTTP transport) before loading it: the recovery buffer;
- ``none``: the cross-group gradient all-reduce flattens this rank's gradients into one copy;
- ``local_sgd``: a sync all-reduces a copy of the parameters;
- ``diloco``: the weights of the last sync (host memory, torchft's default), the outer Nesterov
  momentum (one buffer per parameter, on the device, unless the momentum is 0), and at a sync
  the pseudo-gradients and a copy of the local weights (device).
"""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan.config.sections import FaultTolerance
from torchtitan.fault_tolerance.outer_state import outer_settings


@dataclass(frozen=True)
class FaultToleranceMemory:
    held: int  # device bytes held all step: DiLoCo's outer momentum
    sync: int  # device bytes alive only at the cross-group reduction (or the sync)
    host: int  # host bytes: the recovery buffer, DiLoCo's last synced weights
    note: str


def fault_tolerance_memory(
    ft: FaultTolerance, parameters: int, gradients: int, optimizer_states: int
) -> FaultToleranceMemory | None:
    """This rank's extra bytes, from its parameter, gradient and optimizer-state bytes;
    ``None`` without fault_tolerance.enable."""
    if not ft.enable:
        return None
    recovery = parameters + optimizer_states
    held, host = 0, recovery
    if ft.semi_sync == "diloco":
        _, momentum = outer_settings(ft)
        held = parameters if momentum > 0 else 0
        host += parameters
        sync = 2 * parameters
        what = (
            f"DiLoCo: last synced weights {_mib(parameters)} (host), outer momentum "
            f"{_mib(held)}, pseudo-gradients + local weights {_mib(sync)} at a sync"
        )
    elif ft.semi_sync == "local_sgd":
        sync = parameters
        what = f"LocalSGD: a parameter copy of {_mib(sync)} at a sync"
    else:
        sync = gradients
        what = f"the flattened gradient copy of the cross-group all-reduce {_mib(sync)}"
    note = f"fault tolerance: {what}; recovery buffer {_mib(recovery)} (host)"
    return FaultToleranceMemory(held, sync, host, note)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"
