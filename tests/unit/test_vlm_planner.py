"""The vision tower in the memory estimate and the planner (``models/common/vision/memory.py``, ``planner/memory_terms.py``;
docs/vlm.md, "Planning"): its parameter shapes against the built tower, what it saves against
``saved_tensors_hooks``, the whole estimate against the measured peak of live tensors, and
where it sits under PP, CP and TP."""

from __future__ import annotations

import io
import random
from pathlib import Path

import pytest
import torch

from tests.launcher import run_ranks
from tests.saved_tensors import saved_bytes
from tests.unit import test_estimator as dense
from torchtitan.config.manager import parse_args
from torchtitan.models.common.vision import VisionTower
from torchtitan.models.common.vision.memory import tower_saved_bytes, tower_shapes
from torchtitan.models.common.vision.positions import frame_lengths, patch_rows_cols
from torchtitan.models.common.vision.tower import rope_2d
from torchtitan.models.qwen3_5_vl import QWEN35_VL_FLAVORS
from torchtitan.planner.estimator import estimate_memory

VISION = QWEN35_VL_FLAVORS["debugmodel"].vision  # 2 blocks, width 64, 4 heads, 16-px patches
VLM = ["--model.name", "qwen3_5_vl", "--training.seq_len", "256"]
IMAGES = ["--training.image_tokens_per_sample", "64"]  # a 256 x 256 image: 16 x 16 patches


def test_tower_shapes_count_every_parameter() -> None:
    """The shapes the estimator shards hold exactly the built tower's parameters."""
    root, blocks = tower_shapes(VISION)
    counted = sum(r * c for r, c in [*root, *(s for b in blocks for s in b)])
    assert counted == sum(p.numel() for p in VisionTower(VISION).parameters())
    assert counted == VISION.num_params()


@pytest.mark.parametrize("grids", [[[1, 8, 8]], [[1, 16, 16]], [[1, 16, 16], [1, 16, 16]]])
def test_tower_saved_bytes_match_saved_tensors(grids: list[list[int]]) -> None:
    """The whole tower and one block, fp32 on CPU: the formula equals what autograd saves
    (the attention's CPU math path saves ``H x L`` probabilities per patch, so bytes per
    patch grow with the image)."""
    tower = VisionTower(VISION)
    g = torch.tensor(grids)
    n, per_image = int(g.prod(-1).sum()), int(g[0].prod())
    pixels = torch.randn(n, VISION.patch_dim)
    got = saved_bytes(tower, lambda: tower(pixels, g))
    formula = tower_saved_bytes(VISION, n, per_image, 4, "cpu")
    print(f"{grids}: saved {got} ({got / n:.0f} per patch), formula {formula}")
    assert formula == got
    x = torch.randn(n, VISION.dim, requires_grad=True)
    rows, cols = patch_rows_cols(g, VISION.spatial_merge_size)
    angles = rope_2d(rows, cols, VISION.head_dim, VISION.rope_theta)
    block = saved_bytes(tower, lambda: tower.blocks[0](x, angles, frame_lengths(g)))
    one = tower_saved_bytes(VISION, n, per_image, 4, "cpu") - tower_saved_bytes(
        VISION.__class__(**{**VISION.__dict__, "depth": 1}), n, per_image, 4, "cpu"
    )
    assert one == block


def _write_images(folder: Path, n: int) -> Path:
    """``n`` samples of one 512 x 256 image each (32 x 16 patches: 128 merged tokens) and a
    short caption."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    rng = random.Random(0)
    rows = []
    for i in range(n):
        img = Image.new("RGB", (512, 256), (rng.randint(0, 255), 40, 40 + i))
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        rows.append({"text": f"Look: <image> picture {i}. The end.", "images": [buf.getvalue()]})
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), folder / "vlm.parquet")
    return folder / "vlm.parquet"


@pytest.mark.parametrize("ac", ["none", "full"])
def test_estimate_within_10_percent_of_measured_peak(ac: str, tmp_path: Path) -> None:
    """One rank training ``qwen3_5_vl debugmodel`` on image batches (seq_len 256, 8 samples of
    one 512 x 256 image, 128 image tokens each, fp32): the estimate with the tower's
    activations within the estimator's 10% of the measured peak of live tensors; without
    them (``image_tokens_per_sample`` 0) it is off by more than that."""
    pytest.importorskip("PIL")
    path = _write_images(tmp_path / "data", 16)
    argv = [*dense.BASE, *VLM, "--training.dataset", "vlm", "--training.dataset_path", str(path)]
    argv += ["--job.dump_folder", str(tmp_path), "--activation_checkpoint.mode", ac]
    images = ["--training.image_tokens_per_sample", "128"]
    measured = run_ranks(dense._measure, 1, [*argv, *images], 2)
    dense.assert_estimate_matches(f"qwen3_5_vl debug ac {ac}", [*argv, *images], 1, measured)
    blind = estimate_memory(parse_args(argv), 1, device_type="cpu").tensor_peak
    print(f"without the tower's activations: {blind / 2**20:.1f} MiB")
    assert (measured[0] - blind) / measured[0] > dense.TOLERANCE


def _est(*extra: str, world: int = 1, pp_rank: int | None = None):  # noqa: ANN202
    cfg = parse_args([*dense.BASE, *VLM, *extra])
    return estimate_memory(cfg, world, device_type="cpu", pp_rank=pp_rank)


def test_tower_sits_on_the_first_stage_under_pp() -> None:
    """PP 2: stage 0 holds the tower's parameters, gradients, optimizer state and activations;
    stage 1 none of them (the same with and without image tokens)."""
    pp = ["--parallelism.pipeline_parallel_degree", "2"]
    pp += ["--parallelism.pipeline_parallel_microbatches", "4"]
    params = VISION.num_params() * 4
    with_images = [_est(*pp, *IMAGES, world=2, pp_rank=r) for r in (0, 1)]
    text = [_est(*pp, world=2, pp_rank=r) for r in (0, 1)]
    assert with_images[1].total == text[1].total  # the last stage: no tower at all
    assert with_images[0].per_microbatch_activations > text[0].per_microbatch_activations
    saved = tower_saved_bytes(VISION, 2 * 256, 256, 4, "cpu")  # 8 samples / 4 microbatches
    assert with_images[0].per_microbatch_activations - text[0].per_microbatch_activations == saved
    assert any("vision tower (first stage)" in n for n in with_images[0].notes)
    assert not any("vision tower" in n for n in with_images[1].notes)
    # Against the text decoder alone (qwen3_5, same decoder): stage 0 adds exactly the
    # tower's fp32 parameters (and as much again in gradients), stage 1 nothing.
    decoder = [_est(*pp, "--model.name", "qwen3_5", world=2, pp_rank=r) for r in (0, 1)]
    assert text[0].parameters - decoder[0].parameters == params
    assert text[1].parameters == decoder[1].parameters
    assert text[0].optimizer_states - decoder[0].optimizer_states == 2 * params


def test_cp_does_not_divide_the_towers_activations() -> None:
    """CP 2 halves the decoder's tokens per rank but every cp rank encodes every image: the
    tower's saved bytes per microbatch are the same as on one rank."""
    cp = ["--parallelism.context_parallel_degree", "2"]
    one = _est(*IMAGES).per_microbatch_activations - _est().per_microbatch_activations
    two = _est(*cp, *IMAGES, world=2).per_microbatch_activations
    two -= _est(*cp, world=2).per_microbatch_activations
    assert one == two == tower_saved_bytes(VISION, 8 * 256, 256, 4, "cpu")


def test_tp_replicates_the_tower() -> None:
    """TP 2 (the estimate of a layout the family refuses today; the tower is meant to stay
    replicated, docs/vlm.md): against the text decoder alone (qwen3_5) under the same TP, the
    tower adds its whole parameters and its whole saved bytes, not half."""
    tp = ["--parallelism.tensor_parallel_degree", "2"]
    vl = _est(*tp, *IMAGES, world=2)
    text = _est(*tp, "--model.name", "qwen3_5", world=2)
    assert vl.parameters - text.parameters == VISION.num_params() * 4
    saved = tower_saved_bytes(VISION, 8 * 256, 256, 4, "cpu")
    assert vl.per_microbatch_activations - text.per_microbatch_activations == saved
