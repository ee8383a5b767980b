"""Suite-wide set-up: CPU + gloo everywhere unless a test is marked ``gpu``.

* ``TORCHTITAN_DEVICE=cpu`` (see ``torchtitan/distributed/utils.py``) is set for the session, so
  the multi-rank tests compare gloo CPU ranks even where CUDA is visible (several ranks on one
  GPU must not share it with NCCL), and the scripts they start as subprocesses inherit it.
* ``PYTORCH_NVML_BASED_CUDA_CHECK=1``: ``torch.cuda.is_available()`` asks NVML instead of the CUDA
  runtime, so checking for a GPU here does not initialise CUDA before the launcher forks ranks.
* ``@pytest.mark.gpu`` tests are skipped, with the reason, when no CUDA device is visible; where
  one is, they run with ``TORCHTITAN_DEVICE=cuda``.
"""

from __future__ import annotations

import os

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
os.environ.setdefault("TORCHTITAN_DEVICE", "cpu")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=f"gpu: needs a CUDA device; torch {torch.__version__} sees none")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _device_for_marker(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """``gpu`` tests train on CUDA; every other test keeps the session's CPU setting."""
    if request.node.get_closest_marker("gpu") is not None:
        monkeypatch.setenv("TORCHTITAN_DEVICE", "cuda")


@pytest.fixture
def newest_torch_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planning and validation rules as on torch >= 2.13, for tests of those rules that use PP x TP
    or V-shaped schedules (refused on torch 2.11: tests/unit/test_torch_compat.py tests that)."""
    from torchtitan.tools import torch_compat

    monkeypatch.setattr(torch_compat, "V_SCHEDULES_MIN_TORCH", (0, 0))
    monkeypatch.setattr(torch_compat, "PIPELINE_STAGE_GET_MESH", True)


# Hypothesis profiles for the fuzz tests (tests/unit/test_fuzz_*.py): the fast tier runs a small,
# derandomized budget (the same cases on every run, so CI is deterministic); the ``slow`` tests
# take ``fuzz_slow`` explicitly with their large budgets and a fresh random draw each run.
from hypothesis import HealthCheck, settings  # noqa: E402

_FUZZ_COMMON: dict = dict(
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
        HealthCheck.function_scoped_fixture,
    ],
)
settings.register_profile("fuzz_fast", derandomize=True, max_examples=50, **_FUZZ_COMMON)
settings.register_profile("fuzz_slow", max_examples=1000, **_FUZZ_COMMON)
settings.load_profile("fuzz_fast")
