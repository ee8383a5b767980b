"""torchtitan/tools/torch_compat.py: each shim's choice matches the installed torch's behaviour.

These run in every venv of the window (``./run_tests.sh --torch 2.11`` / ``--torch 2.15``), so a
version boundary guessed wrong fails here, on the version that disagrees.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from torchtitan.tools import torch_compat
from torchtitan.tools.torch_compat import require, torch_version_tuple

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.smoke
def test_installed_torch_is_inside_the_supported_window() -> None:
    got = torch_version_tuple(torch.__version__)
    assert torch_compat.MIN_TORCH <= got <= torch_compat.MAX_TORCH, torch.__version__
    text = (ROOT / "pyproject.toml").read_text()
    lo, hi = torch_compat.MIN_TORCH, (torch_compat.MAX_TORCH[0], torch_compat.MAX_TORCH[1] + 1)
    assert f'"torch>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}"' in text


def test_version_parsing_and_require() -> None:
    assert torch_version_tuple("2.11.0+cu130") == (2, 11)
    assert torch_version_tuple("2.15.0.dev20260101") == (2, 15)
    with pytest.raises(ValueError):
        torch_version_tuple("nightly")
    assert require("x", (2, 0)) is None
    reason = require("float8 rowwise", (9, 1))
    assert reason == f"float8 rowwise needs torch >= 9.1; this is torch {torch.__version__}"


@pytest.mark.smoke
def test_stager_single_use_flag_matches_torch() -> None:
    """Stage twice through one DefaultStager (no pinned memory, so any device): where the flag
    says single use, the second staging fails as it does in torch 2.11; elsewhere it works."""
    stager = DefaultStager(StagingOptions(False, False, False, False))
    sd = {"w": torch.arange(4.0), "meta": {"step": 3, "kind": type}}
    first = stager.stage(sd)
    assert torch.equal(first["w"], sd["w"]) and first["meta"]["step"] == 3  # type: ignore[index]
    try:
        stager.stage(sd)
        reusable = True
    except KeyError:
        reusable = False
    finally:
        stager.close()
    assert reusable == (not torch_compat.DEFAULT_STAGER_SINGLE_USE), torch.__version__


@pytest.mark.smoke
def test_all_gather_autograd_is_the_differentiable_gather() -> None:
    import torch.distributed._functional_collectives as funcol

    expected = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor_autograd
    assert torch_compat.all_gather_autograd is expected


def test_compat_module_is_a_leaf() -> None:
    """Imports only torch and the standard library (no torchtitan: no import cycles)."""
    tree = ast.parse((ROOT / "torchtitan" / "tools" / "torch_compat.py").read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    assert names <= {
        "__future__",
        "contextlib",
        "importlib",
        "inspect",
        "re",
        "collections",
        "typing",
        "warnings",
        "torch",
    }, names


@pytest.mark.smoke
def test_installed_torchao_is_the_release_for_this_torch() -> None:
    """Every venv of the window installs the torchao built for its torch (setup_env.sh)."""
    assert torch_compat.torchao_unusable_reason() is None
    assert set(torch_compat.TORCHAO_FOR_TORCH) == {
        (2, m) for m in range(torch_compat.MIN_TORCH[1], torch_compat.MAX_TORCH[1] + 1)
    }


def test_float8_validation_names_the_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torchao for another torch is a config error naming both installed versions."""
    import importlib.metadata

    from torchtitan.config import ConfigError
    from torchtitan.config.manager import parse_args
    from torchtitan.preflight.validate import validate_config

    real = importlib.metadata.version
    monkeypatch.setattr(
        importlib.metadata, "version", lambda p: "0.9.0" if p == "torchao" else real(p)
    )
    cfg = parse_args(
        ["--job.config_file", str(ROOT / "train_configs/debug_model.toml")]
        + ["--quantize.dense.float8.enable"]
    )
    with pytest.raises(ConfigError) as e:
        validate_config(cfg, world_size=1)
    assert e.value.field == "quantize.dense.float8.enable"
    assert "torchao 0.9.0 is installed" in str(e.value) and torch.__version__ in str(e.value)


@pytest.mark.smoke
def test_pipeline_stage_get_mesh_detection() -> None:
    """torch 2.11's PipelineStage has no get_mesh (found by the 2.11 smoke tier); 2.13+ has it."""
    if torch_compat.TORCH_VERSION >= (2, 13):
        assert torch_compat.PIPELINE_STAGE_GET_MESH
    if torch_compat.TORCH_VERSION == (2, 11):
        assert not torch_compat.PIPELINE_STAGE_GET_MESH


def test_pp_x_tp_refused_where_stages_cannot_send_dtensors(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchtitan.config import ConfigError
    from torchtitan.config.manager import parse_args
    from torchtitan.preflight.validate import validate_config

    monkeypatch.setattr(torch_compat, "PIPELINE_STAGE_GET_MESH", False)
    argv = ["--job.config_file", str(ROOT / "train_configs/debug_model.toml")]
    argv += ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.tensor_parallel_degree"]
    cfg = parse_args([*argv, "2"])
    with pytest.raises(ConfigError) as e:
        validate_config(cfg, world_size=4)
    assert e.value.field == "parallelism.tensor_parallel_degree"
    assert (
        f"needs torch >= 2.13 (PipelineStage(get_mesh=...)); this is torch {torch.__version__}"
        in str(e.value)
    )
    monkeypatch.setattr(torch_compat, "PIPELINE_STAGE_GET_MESH", True)
    validate_config(cfg, world_size=4)


def test_v_schedules_refused_below_2_13(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.11 fails in the first step of ZBVZeroBubble/DualPipeV (a rank sends to itself):
    config validation says so instead, naming the installed torch."""
    from torchtitan.config import ConfigError
    from torchtitan.config.manager import parse_args
    from torchtitan.preflight.validate import validate_config

    monkeypatch.setattr(torch_compat, "TORCH_VERSION", (2, 11))
    argv = ["--job.config_file", str(ROOT / "train_configs/debug_model.toml")]
    argv += ["--parallelism.pipeline_parallel_degree", "2"]
    for schedule in ("ZBVZeroBubble", "DualPipeV"):
        cfg = parse_args([*argv, "--parallelism.pipeline_parallel_schedule", schedule])
        with pytest.raises(ConfigError) as e:
            validate_config(cfg, world_size=2)
        assert e.value.field == "parallelism.pipeline_parallel_schedule"
        assert f"{schedule} needs torch >= 2.13; this is torch {torch.__version__}" in str(e.value)
    cfg = parse_args([*argv, "--parallelism.pipeline_parallel_schedule", "1F1B"])
    validate_config(cfg, world_size=2)
