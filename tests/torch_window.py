"""Skips for the tests of features that config validation refuses on the installed torch.

On torch 2.11 (the oldest of the supported window) pipeline stages cannot exchange DTensors
(PP x TP) and the V-shaped schedules fail at their first step; ``torchtitan/tools/torch_compat.py``
says why and validation names the installed version. Their tests skip there, with that reason.
"""

from __future__ import annotations

import pytest
import torch

from torchtitan.distributed.pipeline_stages import SCHEDULES
from torchtitan.tools import torch_compat

needs_pp_dtensor = pytest.mark.skipif(
    not torch_compat.PIPELINE_STAGE_GET_MESH,
    reason=f"PP x TP needs torch >= 2.13 (PipelineStage get_mesh); this is {torch.__version__}",
)
needs_v_schedules = pytest.mark.skipif(
    torch_compat.TORCH_VERSION < torch_compat.V_SCHEDULES_MIN_TORCH,
    reason=f"V-shaped pipeline schedules need torch >= 2.13; this is {torch.__version__}",
)


def schedule_params(smoke: str | None = None) -> list:
    """Every schedule name as a pytest parameter: V-shaped ones skip where torch lacks them;
    ``smoke`` also marks that one for the smoke tier."""
    params = []
    for name, info in SCHEDULES.items():
        marks = [needs_v_schedules] if info.v_shaped else []
        if name == smoke:
            marks.append(pytest.mark.smoke)
        params.append(pytest.param(name, marks=marks))
    return params
