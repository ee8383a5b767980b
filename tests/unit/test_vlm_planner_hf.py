"""A run started from a Hugging Face folder (``checkpoint.initial_load_in_hf``) of a
vision-language model takes the folder's image token ids (``models.hf_folder_settings``,
``Qwen35VLArgs.HF_FOLDER_FIELDS``): one source for the model and the data (docs/vlm.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.launcher import run_ranks
from tests.unit import test_estimator as dense
from tests.unit.test_vlm_planner import _write_images
from torchtitan.config.manager import parse_args
from torchtitan.models import MODELS, hf_folder_settings, run_args
from torchtitan.models.qwen3_5_vl import QWEN35_VL_FLAVORS

IDS = {"image_token_id": 2045, "vision_start_token_id": 2043, "vision_end_token_id": 2044}
VLM = ["--model.name", "qwen3_5_vl", "--training.seq_len", "256"]


def _folder(path: Path) -> Path:
    """A transformers ``Qwen3_5ForConditionalGeneration`` with the debug flavor's shapes and
    random weights, its ids moved to :data:`IDS` (the flavor's: 2047, 248053, 248054)."""
    transformers = pytest.importorskip("transformers")
    spec = MODELS["qwen3_5_vl"]
    flavor = QWEN35_VL_FLAVORS["debugmodel"]
    as_json = json.loads(json.dumps(spec.hf.config.to_hf(flavor)))  # type: ignore[attr-defined]
    config = transformers.Qwen3_5Config.from_dict({**as_json, **IDS})
    assert all(getattr(config, k) == v != getattr(flavor, k) for k, v in IDS.items())
    torch.manual_seed(0)
    transformers.Qwen3_5ForConditionalGeneration(config).float().save_pretrained(path)
    return path


def test_run_args_take_the_folders_ids(tmp_path: Path) -> None:
    """``run_args`` (what the trainer builds the model from and the data path reads) holds the
    folder's ids; without the folder, the flavor's."""
    folder = _folder(tmp_path / "hf")
    base = [*VLM, "--model.tokenizer_path", "tests/assets/tokenizer"]
    cfg = parse_args([*base, "--checkpoint.initial_load_path", str(folder),
                      "--checkpoint.initial_load_in_hf"])  # fmt: skip
    assert {k: hf_folder_settings(cfg)[k] for k in IDS} == IDS
    args = run_args(cfg, 2048)
    assert {k: getattr(args, k) for k in IDS} == IDS
    plain = run_args(parse_args(base), 2048)
    assert plain.image_token_id == 2047


def _first_step(argv: list[str]) -> tuple[dict[str, int], int, int, int, float, float]:
    """The trainer's model ids, the first batch's placeholders / wrapped images / merged tokens,
    one step's loss and the sum of a tower weight as loaded."""
    from torchtitan.preflight.validate import load_config
    from torchtitan.training.trainer import Trainer

    trainer = Trainer(load_config(argv))
    ids = {k: getattr(trainer.model_args, k) for k in IDS}
    batch = next(iter(trainer.dataloader))
    grids = batch["grid_thw"]
    placeholders = int((batch["inputs"] == IDS["image_token_id"]).sum())
    wrapped = int((batch["inputs"] == IDS["vision_start_token_id"]).sum())
    weight = float(trainer.model_parts[0].visual.merger.linear_fc2.weight.double().sum())
    trainer.step += 1
    loss = float(trainer.train_step()[0])
    trainer.close()
    return ids, placeholders, wrapped, int(grids.prod(-1).sum()) // 4, loss, weight


def test_training_from_the_folder_uses_its_ids_in_model_and_data(tmp_path: Path) -> None:
    """One rank training from the folder on image batches (8 samples of one 512 x 256 image):
    the model is built with the folder's ids and loads its weights, the loader's placeholders
    are the folder's image token (one per merged tower token) with each image wrapped in the
    folder's vision start/end, and a step trains."""
    pytest.importorskip("PIL")
    folder = _folder(tmp_path / "hf")
    data = _write_images(tmp_path / "data", 8)
    argv = [*dense.BASE, *VLM, "--training.dataset", "vlm", "--training.dataset_path", str(data)]
    argv += ["--job.dump_folder", str(tmp_path / "run"), "--checkpoint.initial_load_path",
             str(folder), "--checkpoint.initial_load_in_hf"]  # fmt: skip
    ((ids, placeholders, wrapped, merged, loss, weight),) = run_ranks(_first_step, 1, argv)
    print(f"ids {ids}, placeholders {placeholders} (merged tokens {merged}), loss {loss:.3f}")
    assert ids == IDS
    assert placeholders == merged == 8 * 128
    assert wrapped == 8
    assert 0 < loss < 20
    from safetensors.torch import load_file

    saved = load_file(str(folder / "model.safetensors"))["model.visual.merger.linear_fc2.weight"]
    assert weight == pytest.approx(float(saved.double().sum()), rel=1e-12)
