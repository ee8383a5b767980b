"""The vision tower in the FLOPs per token, MFU, the planner and ``--job.explain``
(``models/common/vision/flops.py``, ``planner/lora_memory.py``, ``planner/explain.py``;
docs/vlm.md, "Planning"): the tower's count equal to torch's FLOP counter, the debug flavor's numbers by hand, the tower's
parameters no longer charged per text token, and the bad values of
``training.image_tokens_per_sample``."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from torchtitan.config import ConfigError, parse_args
from torchtitan.models import runtime_args
from torchtitan.models.common.vision import VisionTower
from torchtitan.models.common.vision.flops import tower_training_flops
from torchtitan.models.qwen3_5.args import QWEN35_FLAVORS
from torchtitan.models.qwen3_5_vl import QWEN35_VL_FLAVORS
from torchtitan.models.spec import DecoderShape
from torchtitan.planner.estimator import model_args_for
from torchtitan.planner.lora_memory import training_flops_per_token

VISION = QWEN35_VL_FLAVORS["debugmodel"].vision  # 2 blocks, width 64, MLP 128, 16-px patches
DEBUG = ["--model.name", "qwen3_5_vl", "--model.flavor", "debugmodel"]
DEBUG += ["--model.tokenizer_path", "tests/assets/tokenizer", "--training.seq_len", "256"]


@pytest.mark.parametrize("grids", [[[1, 8, 8]], [[1, 8, 8], [1, 4, 4]]], ids=["one", "two"])
def test_tower_flops_equal_torch_flop_counter(grids: list[list[int]]) -> None:
    """Forward + backward of the debug tower (pixels without gradient) on one image of 8 x 8
    patches, and on that one and a 4 x 4 one: torch's FLOP counter (convolution, its
    backward, addmm, mm, attention's bmm) equals our count summed per image, exactly."""
    tower = VisionTower(VISION)
    for p in tower.parameters():
        torch.nn.init.normal_(p, std=0.02)
    g = torch.tensor(grids)
    pixels = torch.randn(int(g.prod(-1).sum()), VISION.patch_dim)
    with FlopCounterMode(display=False) as counter:
        tower(pixels, g).sum().backward()
    ours = sum(tower_training_flops(VISION, int(grid.prod())) for grid in g)
    assert counter.get_total_flops() == ours
    if len(grids) == 2:  # 80 patches as images of 64 and 16: less attention than one of 80
        assert ours < tower_training_flops(VISION, 80)
        assert ours == tower_training_flops(VISION, 64) + tower_training_flops(VISION, 16, 16)


def test_mfu_flops_count_the_tower_per_patch_not_per_token() -> None:
    """``qwen3_5_vl debugmodel`` at seq_len 256: without image tokens, the FLOPs per token
    behind MFU are the text decoder's (``qwen3_5 debugmodel``; before, the tower's parameters
    were charged 6 x per text token); with 64 image tokens per sample (256 patches, one
    image) they grow by the tower's count over the row, by hand: per patch 4 * 1536 * 64
    (embedding) + 2 * (6 * (4 * 64^2 + 2 * 64 * 128) + 12 * 64 * 256) (blocks) +
    6 * (4 * 64^2 + 64 * 256) (merger) = 1,376,256, times 256 patches over 256 tokens."""
    cfg = parse_args(DEBUG)
    args = model_args_for(cfg)
    text: DecoderShape = runtime_args(_text_spec(), "debugmodel", args.vocab_size, 256, None)
    none = training_flops_per_token(cfg, args)
    assert none == text.flops_per_token(256)
    cfg = parse_args([*DEBUG, "--training.image_tokens_per_sample", "64"])
    assert training_flops_per_token(cfg, args) - none == 1_376_256
    assert tower_training_flops(VISION, 256) == 256 * 1_376_256


def _text_spec():  # noqa: ANN202
    from torchtitan.models import MODELS

    assert MODELS["qwen3_5"].flavors["debugmodel"] == QWEN35_FLAVORS["debugmodel"]
    return MODELS["qwen3_5"]


def test_explain_names_the_tower_and_its_share() -> None:
    from torchtitan.planner.explain import explain

    cfg = parse_args([*DEBUG, "--training.image_tokens_per_sample", "64"])
    text = explain(cfg, 1, device_type="cpu")
    flops = training_flops_per_token(cfg, model_args_for(cfg))
    share = 256 * 1_376_256 / (flops * 256)
    assert f"vision tower: {VISION.num_params() / 1e6:,.1f} M parameters" in text
    assert f"64 image tokens per sample = 256 patches: 0.35 GFLOP per sample, {share:.1%}" in text
    assert "decoder only" in explain(parse_args(DEBUG), 1, device_type="cpu")
    assert "vision tower" not in explain(parse_args(DEBUG[4:]), 1, device_type="cpu")


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        ([*DEBUG, "--training.image_tokens_per_sample", "-1"], "must be >= 0"),
        ([*DEBUG, "--training.image_tokens_per_sample", "257"], "at most training.seq_len"),
        ([*DEBUG[4:], "--training.image_tokens_per_sample", "8"], "has none"),
    ],
    ids=["negative", "above-seq-len", "text-model"],
)
def test_bad_image_tokens_per_sample_is_one_config_error(argv: list[str], needle: str) -> None:
    from torchtitan.preflight.validate import load_config

    with pytest.raises(ConfigError) as e:
        load_config(argv, world_size=1)
    assert e.value.field == "training.image_tokens_per_sample" and needle in str(e.value)
