"""Tier 1: compile / float8 building blocks and their config rules (no process group)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from torchtitan.config.errors import ConfigError
from torchtitan.distributed.compile import apply_compile, set_compile_cache_dir
from torchtitan.distributed.float8 import (
    apply_float8,
    float8_module_filter,
    float8_unsupported_reason,
)
from torchtitan.models.llama3 import LLAMA3_FLAVORS, Transformer
from torchtitan.preflight.validate import load_config

ROOT = Path(__file__).resolve().parents[2]
DEBUG_TOML = str(ROOT / "train_configs" / "debug_model.toml")
ARGS = dataclasses.replace(LLAMA3_FLAVORS["debugmodel"], n_layers=3, max_seq_len=16)


def _cfg(*overrides: str):  # type: ignore[no-untyped-def]
    return load_config(["--job.config_file", DEBUG_TOML, *overrides])


# ---------------------------------------------------------------- config rules
@pytest.mark.parametrize(
    "overrides, field",
    [
        (
            ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "0"],
            "activation_checkpoint.selective_ac_option",
        ),
        (
            ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "ops"],
            "activation_checkpoint.selective_ac_option",
        ),
        (["--compile.enable", "--compile.components", "model,optimizer"], "compile.components"),
        (
            [
                "--quantize.dense.float8.enable",
                "--quantize.dense.float8.recipe_name", "rowwise",
                "--quantize.dense.float8.enable_fsdp_float8_all_gather",
            ],
            "quantize.dense.float8.enable_fsdp_float8_all_gather",
        ),
        (
            [
                "--quantize.dense.float8.enable",
                "--quantize.dense.float8.precompute_float8_dynamic_scale_for_fsdp",
            ],
            "quantize.dense.float8.precompute_float8_dynamic_scale_for_fsdp",
        ),
    ],
)  # fmt: skip
def test_bad_speed_configs_are_config_errors(overrides: list[str], field: str) -> None:
    with pytest.raises(ConfigError) as e:
        _cfg(*overrides)
    assert e.value.field == field and "Fix:" in str(e.value)


def test_good_speed_configs_parse() -> None:
    cfg = _cfg(
        "--compile.enable",
        "--activation_checkpoint.mode",
        "selective",
        "--activation_checkpoint.selective_ac_option",
        "op",
        "--quantize.dense.float8.enable",
        "--quantize.dense.float8.enable_fsdp_float8_all_gather",
        "--quantize.dense.float8.precompute_float8_dynamic_scale_for_fsdp",
    )
    assert cfg.compile.enable and cfg.compile.components == ["model", "loss"]
    assert cfg.quantize.dense.float8.recipe_name == "tensorwise"


# ---------------------------------------------------------------- float8
def test_float8_support_reasons() -> None:
    assert float8_unsupported_reason("cpu") is None  # emulated on CPU
    assert float8_unsupported_reason("mps", emulate=True) is None
    assert "not implemented" in (float8_unsupported_reason("mps") or "")


def test_float8_filter_rules() -> None:
    keep = float8_module_filter(["output", "wq"], "tensorwise", auto_filter_small_kn=False)
    assert keep(nn.Linear(256, 256), "layers.0.attention.wk")
    assert not keep(nn.Linear(256, 256), "layers.0.attention.wq")
    assert not keep(nn.Linear(256, 2048), "output")
    assert not keep(nn.Linear(250, 256), "layers.0.feed_forward.w1")  # not a multiple of 16
    assert not keep(nn.LayerNorm(256), "layers.0.norm")
    auto = float8_module_filter(["output"], "tensorwise", auto_filter_small_kn=True)
    assert not auto(nn.Linear(256, 256, device="meta"), "layers.0.attention.wk")  # too small
    assert auto(nn.Linear(4096, 14336, device="meta"), "layers.0.feed_forward.w1")


@pytest.mark.smoke
def test_apply_float8_on_meta_keeps_names_and_trains() -> None:
    with torch.device("meta"):
        model = Transformer(ARGS)
    names = [n for n, _ in model.named_parameters()]
    converted = apply_float8(model, auto_filter_small_kn=False, device_type="cpu")
    assert len(converted) == 7 * ARGS.n_layers and "output" not in converted
    assert [n for n, _ in model.named_parameters()] == names
    assert type(model.layers["0"].attention.wq).__name__ == "Float8Linear"
    assert type(model.output).__name__ == "Linear"
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    tokens = torch.randint(0, ARGS.vocab_size, (2, 16))
    model(tokens).float().mean().backward()
    assert model.layers["0"].attention.wq.weight.grad is not None


def test_apply_float8_auto_filter_converts_nothing_small_and_says_so() -> None:
    with torch.device("meta"):
        model = Transformer(ARGS)
    assert apply_float8(model, device_type="cpu") == []


def test_rowwise_with_float8_all_gather_refused() -> None:
    with torch.device("meta"):
        model = Transformer(ARGS)
    with pytest.raises(ValueError, match="tensorwise"):
        apply_float8(model, recipe_name="rowwise", enable_fsdp_float8_all_gather=True)


# ---------------------------------------------------------------- compile
def test_compile_one_graph_for_all_blocks_same_result() -> None:
    """Blocks share code and shapes: dynamo traces one graph and reuses it for every block."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = Transformer(ARGS)
    model.init_weights(seed=0)
    tokens = torch.randint(0, ARGS.vocab_size, (2, 16))
    expected = model(tokens)
    names = [n for n, _ in model.named_parameters()]
    assert apply_compile(model.layers, backend="eager") == ARGS.n_layers
    got = model(tokens)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert [n for n, _ in model.named_parameters()] == names  # no _orig_mod segments


def test_compile_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "env"))
    assert set_compile_cache_dir("") == str(tmp_path / "env")  # empty: the environment's
    got = set_compile_cache_dir("inductor_cache", base_folder=str(tmp_path / "dump"))
    assert got == str(tmp_path / "dump" / "inductor_cache")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == got and Path(got).is_dir()
    # TP/CP coordinates get their own subfolder (once, however often it is called).
    for _ in range(2):
        sub = set_compile_cache_dir("inductor_cache", str(tmp_path / "dump"), rank_subdir="tp1_cp0")
        assert sub == str(tmp_path / "dump" / "inductor_cache" / "tp1_cp0") and Path(sub).is_dir()
