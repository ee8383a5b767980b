"""``python -m torchtitan.convert`` (docs/hf_io.md) for every family: DCP -> HF -> DCP is
bit-identical, the dtype choice casts, a flavor of another shape is refused; the same under
two ranks (each holding half)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.launcher import run_ranks
from tests.tiny_args import tiny_hf_cases
from tests.unit.test_hf_streaming import model_of
from torchtitan import convert
from torchtitan.checkpoint.storage import read_hf_folder, read_model_weights, write_model_weights
from torchtitan.models import MODELS

CASES = tiny_hf_cases()


@pytest.mark.parametrize("case", sorted(CASES))
def test_dcp_to_hf_to_dcp_is_bit_identical(case: str, tmp_path: Path, capsys) -> None:
    family, args = CASES[case]
    sd = {k: v.detach().clone() for k, v in model_of(case, seed=7).state_dict().items()}
    step = write_model_weights(tmp_path / "ck", 3, sd)
    n = convert.to_hf(step, tmp_path / "hf", family, args, None, max_shard_bytes=100_000)
    assert n == len(read_hf_folder(tmp_path / "hf")[1])
    argv = ["from-hf", str(tmp_path / "hf"), str(tmp_path / "back"), "--model", family]
    assert convert.main([*argv, "--step", "5"]) == 0
    out = capsys.readouterr().out
    assert "GB/s" in out and "bitwise equal" in out, out
    back = read_model_weights(tmp_path / "back" / "step-5")
    assert set(back) == set(sd)
    assert all(torch.equal(back[k], sd[k]) for k in sd), [
        k for k in sd if not torch.equal(back[k], sd[k])
    ]


def test_dtype_and_flavor_checks(tmp_path: Path, capsys) -> None:
    family, args = CASES["llama3"]
    sd = {k: v.detach().clone() for k, v in model_of("llama3", seed=1).state_dict().items()}
    step = write_model_weights(tmp_path / "ck", 0, sd)
    convert.to_hf(step, tmp_path / "hf", family, args, torch.bfloat16)
    config, hf = read_hf_folder(tmp_path / "hf")
    assert config["torch_dtype"] == "bfloat16" and all(
        t.dtype == torch.bfloat16 for t in hf.values()
    )
    argv = ["from-hf", str(tmp_path / "hf"), str(tmp_path / "x"), "--model", family]
    assert convert.main([*argv, "--flavor", "debugmodel"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not --flavor debugmodel" in err[0], err
    argv = ["to-hf", str(step), str(tmp_path / "y"), "--model", family, "--flavor", "debugmodel"]
    assert convert.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not a llama3 debugmodel checkpoint" in err[0], err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_an_output_that_cannot_be_created_is_one_line_and_exit_4(tmp_path: Path, capsys) -> None:
    """The step folder rank 0 cannot create (here: its parent is a file; a full disk or a
    read-only mount alike) ends the run with exit 4 and one line, as training's saves do."""
    family, args = CASES["llama3"]
    sd = {k: v.detach().clone() for k, v in model_of("llama3", seed=1).state_dict().items()}
    convert.to_hf(write_model_weights(tmp_path / "ck", 0, sd), tmp_path / "hf", family, args, None)
    (tmp_path / "blocked").write_text("a file where the output folder should go\n")
    argv = ["from-hf", str(tmp_path / "hf"), str(tmp_path / "blocked" / "out"), "--model", family]
    assert convert.main(argv) == 4
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "blocked" in err[0], err


def _convert_on_ranks(argv: list[str]) -> int:
    return convert.main(argv)


def test_two_ranks_write_what_one_writes(tmp_path: Path) -> None:
    family, args = CASES["qwen3-moe"]
    sd = {k: v.detach().clone() for k, v in model_of("qwen3-moe", seed=2).state_dict().items()}
    write_model_weights(tmp_path / "ck", 0, sd)
    adapter = MODELS[family].state_dict_adapter(args)
    from torchtitan.checkpoint.hf_io import save_hf_streaming

    save_hf_streaming(sd, adapter, tmp_path / "hf1", max_shard_bytes=100_000)
    # 2 ranks: from-hf (each reads half), then to-hf back (each writes its own files)
    run_ranks(
        _convert_on_ranks,
        2,
        ["from-hf", str(tmp_path / "hf1"), str(tmp_path / "ck2"), "--model", family],
    )
    back = read_model_weights(tmp_path / "ck2" / "step-0")
    assert all(torch.equal(back[k], sd[k]) for k in sd)
    ours = json.loads((tmp_path / "hf1" / "config.json").read_text())
    assert ours["model_type"] == "qwen3_moe"
    flavors = MODELS[family].flavors
    flavors["_tiny_moe"] = args  # type: ignore[index]
    try:
        run_ranks(
            _convert_on_ranks,
            2,
            [
                "to-hf",
                str(tmp_path / "ck2" / "step-0"),
                str(tmp_path / "hf2"),
                "--model",
                family,
                "--flavor",
                "_tiny_moe",
                "--max-shard-gb",
                "0.0001",
            ],
        )
    finally:
        del flavors["_tiny_moe"]  # type: ignore[attr-defined]
    index = json.loads((tmp_path / "hf2" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    one, two = read_hf_folder(tmp_path / "hf1")[1], read_hf_folder(tmp_path / "hf2")[1]
    assert set(one) == set(two) and all(torch.equal(one[k], two[k]) for k in one)
