"""Where torch's API differs inside the supported window (torch 2.11 to 2.15), the one choice.

Every shim is picked once, at import, and says which torch versions take which path and why.
This module is a leaf: it imports only torch and the standard library, never torchtitan.
Features that need a newer torch than the installed one are refused by config validation with
:func:`require` (which names the installed version), never silently degraded.

How to add a shim: reproduce the difference in the oldest and the newest venv of the window
(``./run_tests.sh --torch 2.11`` / ``--torch 2.15``), add it here with its comment, and use it
from the call site instead of the torch name.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import inspect
import re
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.launcher.api import LaunchConfig
from torch.distributed.pipelining import PipelineStage

__all__ = [
    "DEFAULT_STAGER_SINGLE_USE",
    "MAX_TORCH",
    "MIN_TORCH",
    "TORCH_VERSION",
    "PIPELINE_STAGE_GET_MESH",
    "TORCHAO_FOR_TORCH",
    "TORCHRUN_SHUTDOWN_TIMEOUT",
    "all_gather_autograd",
    "pipeline_dtensor_unsupported_reason",
    "v_schedule_unsupported_reason",
    "require",
    "single_process_dcp",
    "torch_version_tuple",
    "torchao_nf4",
    "torchao_unusable_reason",
]

# The supported window, inclusive of every patch release of both ends (pyproject: >=2.11,<2.16).
MIN_TORCH = (2, 11)
MAX_TORCH = (2, 15)


def torch_version_tuple(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as ``2.11.0+cu130`` or ``2.15.0.dev20260101``."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:
        raise ValueError(f"cannot read a torch version from {version!r}")
    return int(m.group(1)), int(m.group(2))


TORCH_VERSION = torch_version_tuple(torch.__version__)


def require(feature: str, minimum: tuple[int, int]) -> str | None:
    """Why ``feature`` cannot run on the installed torch (``None`` when it can): the reason a
    config validation error gives, naming the installed version and the one needed."""
    if minimum <= TORCH_VERSION:
        return None
    need = ".".join(map(str, minimum))
    return f"{feature} needs torch >= {need}; this is torch {torch.__version__}"


# ---- all-gather with autograd (context parallel's K/V gather; its backward reduce-scatters)
# torch >= 2.12: ``all_gather_single`` (differentiable; ``all_gather_tensor_autograd`` is a
# deprecated alias that warns). torch 2.11: only ``all_gather_tensor_autograd`` exists.
all_gather_autograd: Callable[..., Any]
if hasattr(funcol, "all_gather_single"):
    all_gather_autograd = funcol.all_gather_single
else:
    all_gather_autograd = funcol.all_gather_tensor_autograd


# ---- checkpoint staging (async saves through torch.distributed.checkpoint's DefaultStager)
# torch 2.11: ``DefaultStager._stage`` closes its ``StateDictStager`` after every staging (to break
# a reference cycle), which empties the copy dispatch table, so a second ``stage`` on the same
# stager fails with ``KeyError: <class 'type'>``: one stager per save, and its host buffers
# (pinned ones too) are freed after each save anyway. torch 2.13+: a stager is reusable until its
# owner closes it, so its host buffers are allocated once. 2.12 was not checked: it takes the
# single-use path, which is correct on every version (tests/unit/test_torch_compat.py checks the
# flag against the installed torch's real behaviour).
DEFAULT_STAGER_SINGLE_USE = TORCH_VERSION < (2, 13)


# ---- pipeline stages that exchange DTensor activations (pipeline parallel x tensor parallel)
# torch 2.13+: ``PipelineStage(get_mesh=...)`` rebuilds the DTensor activations and gradients a
# stage receives from its neighbour (TP keeps the residual stream a DTensor). torch 2.11: no
# ``get_mesh`` (stages exchange plain tensors only), so PP x TP is refused by config validation
# there; plain PP (and PP with FSDP or CP) works. Detected from the signature, not the version.
PIPELINE_STAGE_GET_MESH = "get_mesh" in inspect.signature(PipelineStage.__init__).parameters


def pipeline_dtensor_unsupported_reason() -> str | None:
    """Why pipeline stages cannot exchange DTensors on the installed torch, or None."""
    if PIPELINE_STAGE_GET_MESH:
        return None
    return (
        "pipeline parallel with tensor parallel sends DTensor activations between stages, "
        f"which needs torch >= 2.13 (PipelineStage(get_mesh=...)); this is torch {torch.__version__}"
    )


# ---- V-shaped pipeline schedules (ZBVZeroBubble, DualPipeV: stages r and 2*pp-1-r on rank r)
# torch 2.11: the schedule's first step (shape inference in ``_initialize_stages``) sends the
# activation between a rank's two middle stages to the rank itself over the process group, which
# gloo refuses ("Pair is not connected"), at every pp degree. torch 2.13+: passed locally. 2.12
# was not checked and is refused too (the error names the installed version).
V_SCHEDULES_MIN_TORCH = (2, 13)


def v_schedule_unsupported_reason(schedule: str) -> str | None:
    """Why the V-shaped ``schedule`` cannot run on the installed torch, or None."""
    return require(f"the V-shaped pipeline schedule {schedule}", V_SCHEDULES_MIN_TORCH)


# ---- how long torchrun's agent waits for its ranks after forwarding a signal (then SIGKILL)
# torch 2.13+: torchrun takes ``--shutdown-timeout`` (default: $TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else
# 30 s) and hands it to its agent. torch 2.11: no such option and no variable: the agent closes
# its ranks with ``PContext.close``'s default timeout, a fixed 30 s, too short for a large
# checkpoint save. ``torchtitan.launch`` takes the option itself there and makes it that default
# (torchtitan/launch.py). Detected from torchrun's launch config, not the version (2.12 unchecked).
TORCHRUN_SHUTDOWN_TIMEOUT = "shutdown_timeout" in inspect.signature(LaunchConfig).parameters


# ---- torchao (float8 training): each torchao release is built against one torch minor release.
# torch 2.11 (the GPU image) pairs with torchao 0.17; 2.13 to 2.15 with 0.18, the newest on PyPI
# (float8 training checked on 2.11 and 2.13; on 2.15 torchao 0.18 imports, float8 was not run).
# 2.12 follows 2.11's release train (0.17).
TORCHAO_FOR_TORCH = {
    (2, 11): "0.17",
    (2, 12): "0.17",
    (2, 13): "0.18",
    (2, 14): "0.18",
    (2, 15): "0.18",
}


def torchao_unusable_reason() -> str | None:
    """Why the installed torchao is not the release for the installed torch (naming both), or
    None. (Whether it imports is checked where it is used: this module imports only torch.)"""
    want = TORCHAO_FOR_TORCH.get(TORCH_VERSION)
    try:
        have = importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        return f"torchao is not installed (torch {torch.__version__} pairs with torchao {want})"
    if want is not None and torch_version_tuple(have) != torch_version_tuple(want):
        return (
            f"torchao {have} is installed, but torch {torch.__version__} pairs with torchao "
            f"{want} (pip install 'torchao=={want}.*')"
        )
    return None


# ---- torchao NF4 (QLoRA): the module holding ``NF4Tensor``, ``to_nf4`` and ``linear_nf4`` moved.
# torchao 0.17 (torch 2.11/2.12): ``torchao.dtypes.nf4tensor``; 0.18 (torch 2.13-2.15):
# ``torchao.quantization.quantize_.workflows.nf4.nf4_tensor`` (0.18 has no ``dtypes.nf4tensor``,
# 0.17 no ``quantize_.workflows.nf4``: no single path serves both). Picked by the installed
# torchao's version, imported on first use (this module never imports torchao at import time).
_NF4_MODULE_BY_TORCHAO = {
    (0, 17): "torchao.dtypes.nf4tensor",
    (0, 18): "torchao.quantization.quantize_.workflows.nf4.nf4_tensor",
}


def torchao_nf4() -> Any:
    """torchao's NF4 module for the installed torchao (``to_nf4``, ``linear_nf4``, ``NF4Tensor``).
    A torchao outside the table tries the newest layout first, then the older one."""
    import importlib

    try:
        have = torch_version_tuple(importlib.metadata.version("torchao"))
    except importlib.metadata.PackageNotFoundError:
        have = None
    known = _NF4_MODULE_BY_TORCHAO.get(have) if have is not None else None
    candidates = [known] if known else sorted(_NF4_MODULE_BY_TORCHAO.values(), reverse=True)
    errors = []
    for name in candidates:
        try:
            return importlib.import_module(name)
        except ImportError as e:
            errors.append(f"{name}: {e}")
    raise ImportError("torchao's NF4 tensor is not importable (" + "; ".join(errors) + ")")


# DCP's ``save``/``load`` warn "torch.distributed is disabled, unavailable or uninitialized,
# assuming the intent is to save/load in a single process" even when the caller passes
# ``no_dist=True`` (torch 2.11 and 2.13 alike: the flag is or-ed with "no process group" before the
# warning). Our single-process reads and writes (conversion, model-only folders) pass it knowingly.
_SINGLE_PROCESS_DCP = (
    r"torch\.distributed is disabled, unavailable or uninitialized, "
    r"assuming the intent is to (load|save) in a single process"
)


@contextlib.contextmanager
def single_process_dcp() -> Iterator[None]:
    """Around a ``dcp.save``/``dcp.load`` with ``no_dist=True``: that one warning silenced, only
    inside (every other warning, DCP's included, still shows)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_DCP, category=UserWarning)
        yield
