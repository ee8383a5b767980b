"""``--model.n_layers`` (and ``--model.moe_num_experts``): the published MoE shapes at a few
blocks, every other dimension kept, through the one home of a run's args (``models.run_args``
/ ``flavor_args``), seen by the preflight, the estimator and the planner; bad values are one
line with exit code 2 (docs/moe.md, "Published shapes at a few layers")."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from torchtitan.config import parse_args
from torchtitan.config.errors import ConfigError
from torchtitan.models import MODELS, flavor_args, run_args
from torchtitan.planner.estimator import model_args_for
from torchtitan.preflight.validate import validate_config

DEBUG = str(Path(__file__).resolve().parents[2] / "train_configs" / "debug_model.toml")

SHAPES = [
    ("qwen3", "30B-A3B"),
    ("qwen3", "235B-A22B"),
    ("deepseek_v3", "16B"),
    ("deepseek_v3", "671B"),
    ("gpt_oss", "20b"),
    ("gpt_oss", "120b"),
]


def _cfg(*argv: str):  # type: ignore[no-untyped-def]
    return parse_args(["--job.config_file", DEBUG, *argv])


def _fields_but(args, *skip: str) -> dict:  # type: ignore[no-untyped-def]
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.name not in skip}


@pytest.mark.parametrize(("family", "flavor"), SHAPES)
def test_published_shape_at_four_layers(family: str, flavor: str) -> None:
    cfg = _cfg("--model.name", family, "--model.flavor", flavor, "--model.n_layers", "4")
    validate_config(cfg, world_size=1)
    full = MODELS[family].flavors[flavor]
    four = run_args(cfg, vocab_size=2048)
    assert four.n_layers == 4 and four.moe == full.moe and four.dim == full.dim
    skip = ("n_layers", "n_dense_layers", "layer_types", "vocab_size", "max_seq_len")
    want = dataclasses.replace(full, vocab_size=2048, max_seq_len=cfg.training.seq_len)
    assert _fields_but(four, *skip) == _fields_but(want, *skip)
    assert flavor_args(cfg).n_layers == 4
    assert model_args_for(cfg).n_layers == 4  # the estimator and the planner build the same
    assert four.n_moe_layers == (3 if family == "deepseek_v3" else 4)


def test_deepseek_dense_prefix_keeps_its_share() -> None:
    v3 = MODELS["deepseek_v3"].flavors["671B"]  # 3 dense of 61
    assert [v3.with_n_layers(n).n_dense_layers for n in (1, 2, 4, 21, 40, 61)] == [0, 1, 1, 1, 1, 3]
    assert v3.with_n_layers(61) == v3
    debug = MODELS["deepseek_v3"].flavors["debugmodel"]  # 1 dense of 4
    assert [debug.with_n_layers(n).n_dense_layers for n in (2, 4, 8)] == [1, 1, 2]


def test_layer_kinds_follow_the_depth() -> None:
    gpt = MODELS["gpt_oss"].flavors["20b"].with_n_layers(3)
    assert [gpt.is_sliding(i) for i in range(3)] == [True, False, True]
    q35 = MODELS["qwen3_5"].flavors["debugmodel_moe"].with_n_layers(8)
    assert q35.layer_types == q35.layer_types[:4] * 2 and q35.n_full_layers == 2
    q3 = dataclasses.replace(MODELS["qwen3"].flavors["debugmodel"], window_layers=(1, 5))
    assert q3.with_n_layers(4).window_layers == (1,)


def test_expert_count_override() -> None:
    cfg = _cfg(
        "--model.name", "deepseek_v3", "--model.flavor", "671B",
        "--model.n_layers", "4", "--model.moe_num_experts", "16", "--model.mtp_depth", "0",
    )  # fmt: skip
    validate_config(cfg, world_size=1)
    args = run_args(cfg, vocab_size=2048)
    assert (args.moe.num_experts, args.moe.expert_dim, args.moe.top_k) == (16, 2048, 8)
    assert flavor_args(cfg).moe.num_experts == 16
    assert MODELS["deepseek_v3"].num_params(args) < 4e9  # trains on one 80 GB GPU


@pytest.mark.parametrize(
    ("argv", "field", "rule"),
    [
        (["--model.name", "qwen3", "--model.n_layers", "0"], "model.n_layers", ">= 1 or -1"),
        (
            [
                "--model.name",
                "deepseek_v3",
                "--model.flavor",
                "671B",
                "--model.moe_num_experts",
                "12",
            ],
            "model.moe_num_experts",
            "routing cannot use it",
        ),
        (["--model.moe_num_experts", "4"], "model.moe_num_experts", "needs an MoE flavor"),
    ],
)
def test_bad_values_are_one_line(argv: list[str], field: str, rule: str) -> None:
    with pytest.raises(ConfigError) as e:
        validate_config(_cfg(*argv), world_size=1)
    assert str(e.value).count("\n") == 0 and field in str(e.value) and rule in str(e.value)


def test_hf_family_refuses_a_depth(tmp_path: Path) -> None:
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                vocab_size=2048).save_pretrained(tmp_path)  # fmt: skip
    cfg = _cfg("--model.name", "hf", "--model.flavor", str(tmp_path), "--model.n_layers", "1")
    with pytest.raises(ConfigError, match="model.n_layers = 1: hf takes its depth"):
        flavor_args(cfg)


def test_throughput_shape_rows_pass_the_preflight(capsys: pytest.CaptureFixture[str]) -> None:
    """The benchmark rows of the published shapes (benchmarks/throughput.py; scripts/
    gpu_check.sh runs this check in both modes): 6 shapes x (eager, compile, float8 experts),
    each a valid config whose model trains on one 80 GB GPU (<= 3.5B parameters)."""
    import json

    from tests.script_loader import load

    tp = load("benchmarks/throughput.py")
    rows = [(label, argv) for label, argv in tp.LADDER if "--model.n_layers" in argv]
    assert len(rows) == 18
    base = ["--job.config_file", DEBUG, "--training.seq_len", "4096"]
    for label, argv in rows:
        assert tp._preflight(label, [*base, *argv]) == 0
    out = [
        json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")
    ]
    assert [r["label"] for r in out] == [label for label, _ in rows]
    assert all(1.5 < r["params_b"] <= 3.5 for r in out), out
    assert {r["n_layers"] for r in out} == {2, 4}
