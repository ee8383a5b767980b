"""A default run prints no warning its user did not cause (issue #28, docs/errors.md).

``run_train.sh`` on the debug config, 2 CPU ranks, 2 steps, every rank's output shown: no line
says "warn" (Python's ``UserWarning``/``FutureWarning``..., torch's ``[W...]`` C++ warnings, our
logger's ``WARNING``). The detector is checked on a warning the user does cause (bf16 on CPU).
"""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from tests.launcher import run_train_env

ROOT = Path(__file__).resolve().parents[2]
WARNING_LINE = re.compile(r"warn|^\S*\[W\d{3,}|deprecat", re.IGNORECASE)


def warning_lines(text: str, *paths: Path) -> list[str]:
    """The lines that say "warn"; the checkout's and ``paths`` (folder names such as
    ``wt-warn``) do not count."""
    for path in sorted({str(ROOT), *map(str, paths)}, key=len, reverse=True):
        text = text.replace(path, "<path>")
    return [line for line in text.splitlines() if WARNING_LINE.search(line)]


def _env() -> dict[str, str]:
    return run_train_env("all", drop=("PYTHONWARNINGS",))


def test_default_run_prints_no_warning(tmp_path: Path) -> None:
    cmd = [
        str(ROOT / "run_train.sh"),
        "--job.dump_folder",
        str(tmp_path / "out"),
        "--training.steps",
        "2",
        "--training.seq_len",
        "128",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "training done" in out
    assert warning_lines(out, tmp_path) == [], out[-4000:]


def test_a_warning_from_our_code_fails_the_suite(request: pytest.FixtureRequest) -> None:
    """pyproject's ``filterwarnings``: a warning raised from torchtitan or a test module (by
    stacklevel too) is an error here, so a new one fails its test instead of joining pytest's
    summary; so is DCP's single-process note outside ``single_process_dcp``."""
    if request.config.getoption("pythonwarnings"):
        pytest.skip("pytest -W given: it overrides pyproject's filterwarnings (to list warnings)")
    import torch.distributed.checkpoint as dcp

    from torchtitan.data.dataloader import ParallelAwareDataloader
    from torchtitan.tools.torch_compat import single_process_dcp

    with pytest.raises(UserWarning, match="probe"):
        warnings.warn_explicit("probe", UserWarning, "x.py", 1, module="torchtitan.probe")
    with pytest.raises(UserWarning, match="empty state for dp_rank_0"):  # names this caller
        ParallelAwareDataloader([0], 0, 1, batch_size=1).load_state_dict({})
    with pytest.raises(UserWarning, match="torch.distributed is disabled"):
        dcp.save({"x": torch.zeros(1)}, checkpoint_id=str(ROOT / "no-such-dir"), no_dist=True)
    with warnings.catch_warnings(record=True) as seen, single_process_dcp():
        warnings.warn(
            "torch.distributed is disabled, unavailable or uninitialized, assuming the intent "
            "is to load in a single process.",
            stacklevel=1,
        )
    assert seen == []


def test_the_detector_sees_a_warning_the_user_caused() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torchtitan.config",
            "--job.config_file",
            str(ROOT / "train_configs" / "debug_model.toml"),
            "--training.mixed_precision_param",
            "bfloat16",
        ],
        cwd=ROOT,
        env=dict(_env(), TORCHTITAN_DEVICE="cpu"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    found = warning_lines(proc.stdout + proc.stderr)
    assert len(found) == 1 and "bf16 matmuls are far slower" in found[0], found
