"""Image-text data for vision-language training (``data/vlm_images.py``,
``data/vlm_dataset.py``, ``scripts/make_vlm_data.py``; docs/vlm.md): patches equal to
transformers' Qwen-VL image processor, parquet and tar shards giving the same samples, the
loss mask, bad images skipped and counted, unpaired markers an error naming the sample, and a
few optimizer steps of the debug vision-language model on these batches."""

from __future__ import annotations

import dataclasses
import io
import logging
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from torchtitan.data.tokenizer import build_tokenizer
from torchtitan.data.vlm_dataset import ImageTokens, VLMDataset, collate, read_source
from torchtitan.data.vlm_images import ImageRules, decode, patchify, smart_resize
from torchtitan.loss.chunked import IGNORE_INDEX

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import make_vlm_data  # noqa: E402

TOKENIZER = ROOT / "tests/assets/tokenizer"
IMAGE_ID = 2047  # the debug flavor's placeholder: a reserved id the tokenizer never emits
RULES = ImageRules(min_pixels=32 * 32, max_pixels=64 * 64 * 2, max_source_pixels=300 * 300)


@pytest.mark.parametrize("size", [(37, 53), (120, 90), (9, 15), (64, 64)])
def test_patches_equal_transformers_processor(size: tuple[int, int]) -> None:
    pil = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    from PIL import Image

    rules = ImageRules(patch_size=4, min_pixels=8 * 8 * 4, max_pixels=64 * 64)
    rgb = np.random.default_rng(sum(size)).integers(0, 255, (*size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    pixels, grid = patchify(decode(buf.getvalue(), rules), rules)
    processor = pil.Qwen2VLImageProcessorPil(
        patch_size=4,
        merge_size=2,
        temporal_patch_size=2,
        image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
        size={"shortest_edge": 8 * 8 * 4, "longest_edge": 64 * 64},
    )
    ref = processor(images=[Image.fromarray(rgb)], return_tensors="pt")
    assert [list(grid)] == ref["image_grid_thw"].tolist()
    assert torch.allclose(pixels, ref["pixel_values"], atol=1e-6, rtol=0)


@pytest.mark.parametrize("hw", [(10, 10), (1000, 30), (333, 777), (5000, 4000)])
def test_smart_resize_keeps_the_rules(hw: tuple[int, int]) -> None:
    h, w = smart_resize(*hw, factor=32, min_pixels=32 * 32 * 4, max_pixels=32 * 32 * 256)
    assert h % 32 == 0 and w % 32 == 0
    assert 32 * 32 * 4 <= h * w <= 32 * 32 * 256
    assert abs(h / w - hw[0] / hw[1]) / (hw[0] / hw[1]) < 0.35


def _dataset(paths: list[Path], **kw: int) -> VLMDataset:
    return VLMDataset(paths, build_tokenizer(TOKENIZER), 96, RULES, ImageTokens(IMAGE_ID), **kw)


def test_parquet_and_tar_give_the_same_masked_samples(tmp_path: Path) -> None:
    make_vlm_data.write(tmp_path, 6, seed=1, bad=False, oversized=400)
    from_parquet = list(_dataset([tmp_path / "vlm.parquet"]))
    from_tar = list(_dataset([tmp_path / "vlm-000.tar"]))
    assert len(from_parquet) == len(from_tar) == 6
    for a, b in zip(from_parquet, from_tar, strict=True):
        assert torch.equal(a.inputs, b.inputs) and torch.equal(a.pixel_values, b.pixel_values)
        assert torch.equal(a.grid_thw, b.grid_thw)
        placeholders = int((a.inputs == IMAGE_ID).sum())
        assert placeholders == int(a.grid_thw.prod(-1).sum()) // 4
        assert a.pixel_values.shape == (int(a.grid_thw.prod(-1).sum()), 3 * 2 * 16 * 16)
        # the loss never targets a placeholder; every other real next token is a target
        assert not bool((a.labels == IMAGE_ID).any())
        target = torch.cat([a.inputs[1:], a.labels[-1:]])
        real = (target != IMAGE_ID) & (a.labels != IGNORE_INDEX)
        assert torch.equal(a.labels[real], target[real])
    ranks = [list(_dataset([tmp_path / "vlm.parquet"], dp_rank=r, dp_world=2)) for r in (0, 1)]
    assert [len(r) for r in ranks] == [3, 3]
    assert torch.equal(ranks[1][0].inputs, from_parquet[1].inputs)


def test_bad_images_skipped_counted_and_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    make_vlm_data.write(tmp_path, 4, seed=2, bad=True, oversized=400)
    rows = list(read_source(tmp_path / "vlm.parquet"))
    good, corrupt, oversized, unpaired = rows[:4], rows[4], rows[5], rows[6]
    data = _dataset([])
    caplog.set_level(logging.WARNING)
    for raw in [*good, corrupt, corrupt, oversized]:
        data.sample(raw)
    assert data.skipped == {"bad image": 3}
    assert sum("skipping sample" in r.message for r in caplog.records) == 1
    with pytest.raises(ValueError, match="2 <image> placeholders but 1 images") as err:
        data.sample(unpaired)
    assert "row 6" in str(err.value) and "\n" not in str(err.value)


def test_debug_model_learns_from_image_batches(tmp_path: Path) -> None:
    """Eight AdamW steps of a tiny qwen3_5_vl (vision tower included) on one batch of four
    samples: the masked loss falls by more than half, and the tower's weights get gradients."""
    from tests.tiny_args import tiny_qwen3_5
    from torchtitan.models.common.vision import VisionArgs
    from torchtitan.models.qwen3_5_vl import Qwen35VLArgs, Qwen35VLModel

    text = tiny_qwen3_5(vocab_size=2048, max_seq_len=96)
    fields = {f: getattr(text, f) for f in text.__dataclass_fields__ if f != "qk_norm"}
    tower = VisionArgs(depth=1, dim=32, n_heads=2, intermediate_size=48, out_dim=64)
    tower = dataclasses.replace(tower, num_position_embeddings=16)
    args = Qwen35VLArgs(**fields, vision=tower, image_token_id=IMAGE_ID)

    make_vlm_data.write(tmp_path, 4, seed=3, bad=False, oversized=400)
    batch = collate(list(_dataset([tmp_path / "vlm.parquet"])))
    torch.manual_seed(0)
    model = Qwen35VLModel(args)
    model.init_weights(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        logits = model(
            batch["inputs"], pixel_values=batch["pixel_values"], grid_thw=batch["grid_thw"]
        )
        loss = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX
        )
        opt.zero_grad()
        loss.backward()
        assert model.visual.patch_embed.proj.weight.grad.abs().sum() > 0
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_loader_resumes_at_the_next_batch(tmp_path: Path) -> None:
    """The rank's loader state after two batches, loaded into a new loader: its next batch is
    the third batch of an uninterrupted run (epochs repeat with ``infinite``)."""
    from torchtitan.data.dataloader import ParallelAwareDataloader

    make_vlm_data.write(tmp_path, 5, seed=5, bad=False, oversized=400)

    def loader() -> ParallelAwareDataloader:
        data = VLMDataset(
            [tmp_path / "vlm.parquet"],
            build_tokenizer(TOKENIZER),
            96,
            RULES,
            ImageTokens(IMAGE_ID),
            infinite=True,
        )
        return ParallelAwareDataloader(data, 0, 1, batch_size=2, collate_fn=collate)

    straight = iter(loader())
    batches = [next(straight) for _ in range(4)]
    first = loader()
    it = iter(first)
    next(it), next(it)
    state = first.state_dict()
    resumed = loader()
    resumed.load_state_dict(state)
    again = iter(resumed)
    for want in batches[2:]:
        got = next(again)
        assert all(torch.equal(got[k], want[k]) for k in want)
