"""Initial weights: from a model-only checkpoint (scripts/convert_from_hf.py's output) and
directly from a Hugging Face folder; the trainer's parameters must equal the given weights."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from tests.launcher import run_ranks
from tests.parity import DEBUG_TOML, TINY
from tests.script_loader import load
from torchtitan.checkpoint.storage import write_model_weights
from torchtitan.models.llama3.args import LLAMA3_FLAVORS
from torchtitan.models.llama3.model import Transformer

ROOT = Path(__file__).resolve().parents[2]


def _trainer_weights(argv: list[str], expected: dict[str, torch.Tensor]) -> list[str]:
    """Build the trainer (which loads the initial weights); the names whose full weights differ
    from ``expected`` (compared here: tensors cannot travel back through the result queue)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from torchtitan.preflight.validate import load_config
    from torchtitan.training.trainer import Trainer

    trainer = Trainer(load_config(["--job.config_file", DEBUG_TOML, *argv]))
    try:
        assert trainer.step == 0
        sd = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True))
        if set(sd) != set(expected):
            extra, missing = sorted(set(sd) - set(expected)), sorted(set(expected) - set(sd))
            return [f"names differ: trainer only {extra[:3]}, given only {missing[:3]}"]
        return [k for k in expected if not torch.equal(sd[k], expected[k])]
    finally:
        trainer.close()


def test_initial_weights_from_checkpoint_and_from_hf(tmp_path: Path) -> None:
    args = dataclasses.replace(LLAMA3_FLAVORS["debugmodel"], max_seq_len=64)
    model = Transformer(args)
    model.init_weights(seed=123)  # type: ignore[operator]
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    folder = write_model_weights(tmp_path / "seed", 0, expected)
    to_hf = load("scripts/convert_to_hf.py", "to_hf")
    to_hf.convert(folder, tmp_path / "hf", args, torch.float32, shard_mb=4096)

    base = [*TINY, "--training.local_batch_size", "4", "--checkpoint.enable"]
    for extra in (
        ["--checkpoint.initial_load_path", str(folder)],
        ["--checkpoint.initial_load_path", str(tmp_path / "hf"), "--checkpoint.initial_load_in_hf"],
    ):
        dump = tmp_path / f"run{len(extra)}"
        # 2 ranks: the full weights are resharded into FSDP shards on load.
        argv = [*base, "--job.dump_folder", str(dump), *extra]
        for bad in run_ranks(_trainer_weights, 2, argv, expected):
            assert not bad, f"{extra}: weights differ from the given ones: {bad[:5]}"


def test_initial_load_path_is_used_with_checkpointing_off(tmp_path: Path) -> None:
    """checkpoint.initial_load_path (DCP, and a Hugging Face folder) with checkpoint.enable off
    (the debug config's default): the first step's loss is the loaded model's (that of the same
    load with checkpointing on), not a random init's; and nothing is saved."""
    from tests.parity import losses, train_metrics

    args = dataclasses.replace(LLAMA3_FLAVORS["debugmodel"], max_seq_len=64)
    model = Transformer(args)
    model.init_weights(seed=123)  # type: ignore[operator]
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    folder = write_model_weights(tmp_path / "seed", 0, weights)
    load("scripts/convert_to_hf.py", "to_hf").convert(
        folder, tmp_path / "hf", args, torch.float32, shard_mb=4096
    )
    dcp = ["--checkpoint.initial_load_path", str(folder)]
    hf = ["--checkpoint.initial_load_path", str(tmp_path / "hf"), "--checkpoint.initial_load_in_hf"]
    runs = {
        "random": [],
        "dcp, saving on": [*dcp, "--checkpoint.enable"],
        "dcp": dcp,
        "hf": hf,
    }
    dumps = {k: tmp_path / f"run_{i}" for i, k in enumerate(runs)}
    loss = {k: losses(train_metrics(v, 1, dumps[k], steps=1))[0] for k, v in runs.items()}
    assert abs(loss["random"] - loss["dcp, saving on"]) > 1e-3, loss
    assert loss["dcp"] == loss["dcp, saving on"], loss
    assert abs(loss["hf"] - loss["dcp"]) <= 1e-5 * abs(loss["dcp"]), loss
    assert not (dumps["dcp"] / "checkpoint").exists() and not (dumps["hf"] / "checkpoint").exists()
