"""Qwen3.5 with vision under pipeline and context parallel (docs/vlm.md, "Pipeline and context
parallel"): the per-sample image inputs (``models/qwen3_5_vl/images.py``) split by torch's
microbatch splitter give every microbatch exactly its samples' images, and every cp shard its
placeholders' image tokens and whole-sequence MRoPE positions; in the slow tier, PP 2 (1F1B and
GPipe) and CP 2 train like one process over 10 steps of image batches (losses within 1e-5
relative, grad norms within 5e-4)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks

from tests.launcher import run_ranks
from tests.parity import ROOT, _train, assert_losses_match
from tests.tiny_args import tiny_qwen3_5_vl
from torchtitan.distributed.context_parallel import ContextParallel
from torchtitan.models import MODELS

sys.path.insert(0, str(ROOT / "scripts"))
import make_vlm_data  # noqa: E402

IMAGE = 250  # tiny_qwen3_5_vl's placeholder
PATCH_DIM = 3 * 2 * 4 * 4
SEQ = 32


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Four rows of 32 tokens: row 0 one image (tokens 3-8), row 1 none, row 2 two images
    (10-17, 20), row 3 one image (20-27); under CP 2 (chunks of 8 tokens: rank 0 holds 0-7 and
    24-31, rank 1 8-23) row 0's and row 3's images cross the boundary between the ranks."""
    tokens = torch.randint(0, 240, (4, SEQ), generator=torch.Generator().manual_seed(0))
    tokens[0, 3:9] = IMAGE
    tokens[2, 10:18] = IMAGE
    tokens[2, 20] = IMAGE
    tokens[3, 20:28] = IMAGE
    grids = torch.tensor([[1, 4, 6], [1, 8, 4], [1, 2, 2], [1, 4, 8]])  # 6, 8, 1, 8 tokens
    pixels = torch.randn(
        int(grids.prod(-1).sum()), PATCH_DIM, generator=torch.Generator().manual_seed(1)
    )
    return tokens, pixels, grids


def _model() -> Any:
    model = MODELS["qwen3_5_vl"].build(tiny_qwen3_5_vl())
    model.init_weights(seed=0)
    return model


def test_pipeline_microbatches_get_their_samples_images() -> None:
    """torch's splitter (the schedule's) cuts the per-sample inputs into 4 microbatches of one
    row: each holds exactly its row's patches and grids (row 1 none: the tower runs on zero
    patches), and each microbatch's logits equal that row of the whole batch's forward on the
    collated (ragged) images (1e-5)."""
    model = _model()
    tokens, pixels, grids = _batch()
    whole = model(tokens, pixel_values=pixels, grid_thw=grids)
    extra = model.image_inputs(tokens, pixels, grids)
    args, kwargs = split_args_kwargs_into_chunks((tokens,), extra, 4)
    images = [pixels[:24], pixels[24:24], pixels[24:60], pixels[60:]]  # rows' patches
    row_grids = [grids[:1], grids[:0], grids[1:3], grids[3:]]
    for row, ((mb_tokens,), mb) in enumerate(zip(args, kwargs, strict=True)):
        size = mb["grid_thw"].prod(-1)
        assert torch.equal(mb["grid_thw"][size > 0], row_grids[row])
        n = int(size.sum())
        assert torch.equal(mb["pixel_values"][0, :n], images[row])
        assert not bool(mb["pixel_values"][0, n:].any())  # the padding
        logits = model(mb_tokens, **mb)
        torch.testing.assert_close(logits, whole[row : row + 1], rtol=1e-5, atol=1e-5)


def test_a_later_stage_without_mrope_positions_refuses_an_image_batch() -> None:
    """A stage without the embedding cannot recompute MRoPE from hidden states: given an
    image batch without ``mrope_positions`` it raises one line instead of rotating by text
    positions."""
    model = _model()
    tokens, pixels, grids = _batch()
    extra = model.image_inputs(tokens, pixels, grids)
    model.tok_embeddings = None
    h = torch.zeros(4, SEQ, model.args.dim)
    del extra["mrope_positions"]
    with pytest.raises(ValueError, match="needs mrope_positions") as err:
        model(h, **extra)
    assert "\n" not in str(err.value)


class _CPMesh:
    """The two things ``ContextParallel`` reads of a cp mesh (no process group here)."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def get_local_rank(self) -> int:
        return self._rank


def test_cp_shards_get_their_image_tokens_and_positions() -> None:
    """CP 2 head-tail (no pipeline: the collated patches, per-sample grids): each rank's share
    keeps the images whole (its tower sees the whole batch's), and its embeddings and MRoPE positions equal the whole sequence's at its token
    positions, exactly, with images crossing the shard boundary (row 0's tokens 3-7 on rank
    0 and 8 on rank 1; row 3's 20-23 on rank 1 and 24-27 on rank 0); the embeddings' gradient
    reaches the tower on both ranks."""
    model = _model()
    tokens, pixels, grids = _batch()
    extra = model.image_inputs(tokens, pixels, grids, microbatched=False)
    assert extra["pixel_values"] is pixels  # no pipeline: not padded per row
    whole = model._embed(tokens, pixels, grids, None)
    plan = MODELS["qwen3_5_vl"].parallel_plan(model.args).context_parallel
    assert plan is not None
    for rank, (head, tail) in enumerate([(range(0, 8), range(24, 32)), (range(8, 24), ())]):
        cp = ContextParallel(_CPMesh(2, rank), "allgather", [model], whole_inputs=plan.whole_inputs)  # type: ignore[arg-type]
        local, _, sharded = cp.shard(tokens, tokens, extra)
        where = list(head) + list(tail) if rank == 0 else list(range(8, 24))
        assert torch.equal(local, tokens[:, where])
        assert torch.equal(sharded["pixel_values"], extra["pixel_values"])
        assert torch.equal(sharded["mrope_positions"], extra["mrope_positions"][:, where])
        h = model._embed(
            local, sharded["pixel_values"], sharded["grid_thw"], sharded["visual_index"]
        )
        assert torch.equal(h, whole[:, where])
        model.zero_grad()
        h.sum().backward()
        grad = model.visual.merger.linear_fc2.weight.grad
        assert grad is not None and bool(grad.any())


VLM = ["--model.name", "qwen3_5_vl", "--training.dataset", "vlm"]
RUN = ["--training.mixed_precision_param", "float32", "--metrics.log_freq", "1"]
RUN += ["--metrics.no-enable_tensorboard", "--checkpoint.no-enable", "--validation.no-enable"]
RUN += ["--training.seq_len", "256", "--lr_scheduler.warmup_steps", "2"]
# (the debug config's 2e-3 drives these short captions' loss from 8.3 to 0.15 in 10 steps,
# where a relative 1e-5 is below fp32's reduction-order noise: 2e-4 keeps it above 1)
RUN += ["--optimizer.lr", "2e-4"]
RUN += ["--comm.train_timeout_seconds", "300"]
STEPS = 10


@pytest.fixture(scope="module")
def vlm_reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], list[dict]]:
    """16 image-text samples (every 4th text only; one or two images of 66-80 merged tokens
    from token 5 on, so at seq 256 under CP 2 every image crosses the shard boundary at 64),
    and one process's 10 steps of 4 of them."""
    folder = tmp_path_factory.mktemp("vlm_pp_cp")
    make_vlm_data.write(folder / "data", 16, 4, False, 400, text_only_every=4)
    base = [*VLM, "--training.dataset_path", str(folder / "data" / "vlm.parquet"), *RUN]
    base += ["--training.steps", str(STEPS), "--training.local_batch_size", "4"]
    (one,) = run_ranks(_train, 1, base, str(folder / "one"), timeout=900.0)
    return base, one


def _compare(
    reference: tuple[list[str], list[dict]],
    tmp_path: Path,
    layout: list[str],
    label: str,
    world: int = 2,
) -> None:
    base, one = reference
    got = run_ranks(_train, world, [*base, *layout], str(tmp_path / "run"), timeout=900.0)[0]
    assert got is not None
    print(label, "one process:", [r["loss"] for r in one], "layout:", [r["loss"] for r in got])
    assert_losses_match([r["loss"] for r in one], [r["loss"] for r in got], 1e-5, label)
    for a, b in zip(one, got, strict=True):
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 5e-4 * abs(a["grad_norm"]), (a, b)
    assert one[-1]["loss"] < one[0]["loss"]


PP2 = ["--parallelism.pipeline_parallel_degree", "2"]
PP2 += ["--parallelism.pipeline_parallel_microbatch_size", "1"]


def test_pp2_small_equals_one_process_on_image_batches(tmp_path: Path) -> None:
    """The fast tier's case: PP 2 1F1B, 3 steps of 2 samples in 2 microbatches (step 2's second
    sample is text only: its microbatch runs the tower on zero patches on stage 0)."""
    make_vlm_data.write(tmp_path / "data", 8, 4, False, 400, text_only_every=4)
    base = [*VLM, "--training.dataset_path", str(tmp_path / "data" / "vlm.parquet"), *RUN]
    base += ["--training.steps", "3", "--training.local_batch_size", "2"]
    (one,) = run_ranks(_train, 1, base, str(tmp_path / "one"), timeout=600.0)
    layout = [*PP2, "--parallelism.pipeline_parallel_schedule", "1F1B"]
    _compare((base, one), tmp_path, layout, "qwen3_5_vl PP 2 1F1B (3 steps)")


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1F1B", "GPipe"])
def test_pp2_equals_one_process_on_image_batches(
    vlm_reference: tuple[list[str], list[dict]], tmp_path: Path, schedule: str
) -> None:
    """PP 2, 4 microbatches of one sample (the tower and the embedding on stage 0; a text-only
    sample's microbatch runs the tower on zero patches)."""
    layout = [*PP2, "--parallelism.pipeline_parallel_schedule", schedule]
    _compare(vlm_reference, tmp_path, layout, f"qwen3_5_vl PP 2 {schedule}")


@pytest.mark.slow
def test_cp2_equals_one_process_on_image_batches(
    vlm_reference: tuple[list[str], list[dict]], tmp_path: Path
) -> None:
    """CP 2 (all-gather, head-tail; the DeltaNet's state chained over cp): every image
    crosses the shard boundary; the tower runs on the whole batch on both ranks."""
    layout = ["--parallelism.context_parallel_degree", "2"]
    _compare(vlm_reference, tmp_path, layout, "qwen3_5_vl CP 2")


FSDP2 = ["--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "2"]
"""FSDP 2 with the reference's global batch of 4 (sample i is data-parallel rank i % 2's)."""
CP2 = ["--parallelism.context_parallel_degree", "2"]
COMPOSED = {
    # PP 2 x CP 2: microbatches split the per-sample inputs along the batch, CP the sequence
    # inputs along the sequence; the images stay whole on both cp ranks of the first stage
    "PP 2 x CP 2": [*PP2, "--parallelism.pipeline_parallel_schedule", "1F1B", *CP2],
    # the tower's FSDP units sharded over dp_shard x cp, the images each dp rank's own
    "FSDP 2 x CP 2": [*FSDP2, *CP2],
    # stage 0 on pp rank 0 with the tower, its FSDP units over dp_shard
    "PP 2 x FSDP 2": [*PP2, "--parallelism.pipeline_parallel_schedule", "1F1B", *FSDP2],
    # 4 stages, 2 per rank: rank 0 holds stage 0 (the tower) and stage 2 (none)
    "PP 2 Interleaved1F1B": [*PP2, "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"],
}


@pytest.mark.slow
@pytest.mark.parametrize("label", sorted(COMPOSED))
def test_composed_layouts_equal_one_process_on_image_batches(
    vlm_reference: tuple[list[str], list[dict]], tmp_path: Path, label: str
) -> None:
    """PP and CP composed with each other and with FSDP, and an interleaved schedule."""
    layout = COMPOSED[label]
    world = 4 if label.count(" x ") else 2
    _compare(vlm_reference, tmp_path, layout, f"qwen3_5_vl {label}", world=world)
