"""Kimi K2.5 beyond data parallel (docs/vlm.md, "Kimi K2.5"): activation checkpointing and
compile of the MoonViT blocks (``extra_blocks``) change no loss; under tensor parallel (alone and
with FSDP) the tower and projector run whole on every TP rank and 10 steps of image batches
through the trainer equal one process (losses within 1e-5 relative; the reported gradient norms
and the final weights within the bounds ``tests/integration/test_vlm_parallel.py`` uses for
qwen3_5_vl); the tower's gradients are equal on both TP ranks. Pipeline (the tower and
projector on the first stage, image inputs per sample) and context parallel (the tower whole on
every cp rank) equal one process as ``tests/integration/test_vlm_pp_cp.py`` checks qwen3_5_vl
(losses 1e-5, grad norms 5e-4, its learning rate).

The data (``scripts/make_vlm_data.py``, 8 samples) has an image in the even samples only, so a
one-sample batch has no image every second step (the tower and projector then run on zero
patches on both TP ranks).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.checkpoint_helpers import read_checkpoint
from tests.integration.test_vlm_run import FP32, _train
from tests.launcher import run_ranks
from tests.parity import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import make_vlm_data  # noqa: E402

KIMI = ["--model.name", "kimi_k25", "--training.dataset", "vlm"]
STEPS = 10
EXPORT = ["--checkpoint.enable", "--checkpoint.interval", str(STEPS)]
EXPORT += ["--checkpoint.last_save_model_only"]  # the final weights, model only
LR = ["--optimizer.lr", "3e-4"]  # as test_vlm_parallel.py (its reasons)

Run = tuple[list[float], list[float], dict[str, torch.Tensor]]
"""Per-step losses, per-step gradient norms, the final weights."""


def _run(data: Path, dump: Path, ranks: int, argv: list[str]) -> Run:
    base = [*KIMI, "--training.dataset_path", str(data), *FP32, *EXPORT, *LR]
    base += ["--training.steps", str(STEPS)]
    metrics = run_ranks(_train, ranks, [*base, *argv], str(dump), timeout=900.0)[0]
    weights = read_checkpoint(dump / "checkpoint" / f"step-{STEPS}")
    tensors = {k: v for k, v in weights.items() if isinstance(v, torch.Tensor)}
    return [m["loss"] for m in metrics], [m["grad_norm"] for m in metrics], tensors


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("kimi_data")
    make_vlm_data.write(folder, 8, 4, False, 400, text_only_every=2)
    return folder / "vlm.parquet"


@pytest.fixture(scope="module")
def one_process(data: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], Run]:
    """The one-process run at a local batch size (each made once per module)."""
    runs: dict[int, Run] = {}

    def get(batch: int) -> Run:
        if batch not in runs:
            dump = tmp_path_factory.mktemp(f"one_{batch}")
            runs[batch] = _run(data, dump, 1, ["--training.local_batch_size", str(batch)])
        return runs[batch]

    return get


def _worst(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(x) for x, y in zip(a, b, strict=True))


def _assert_equal_runs(
    ref: Run, got: Run, label: str, weights_tol: float = 3e-5, norm_tol: float = 5e-4
) -> None:
    """Losses within 1e-5 relative; every final weight within ``weights_tol`` (relative and
    absolute); gradient norms within ``norm_tol`` relative (the bounds of
    ``test_vlm_parallel.py: _assert_equal_runs``)."""
    (loss_a, norm_a, w_a), (loss_b, norm_b, w_b) = ref, got
    assert len(loss_a) == len(loss_b) == STEPS
    assert set(w_a) == set(w_b) and any("vision_tower." in k for k in w_a), sorted(w_a)[:5]
    worst_w = max(w_a, key=lambda k: float((w_a[k] - w_b[k]).abs().max()))
    print(
        f"{label}: one process {loss_a}\n{label}: parallel {loss_b}\n{label}: worst relative "
        f"loss difference {_worst(loss_a, loss_b):.2e}, grad norm {_worst(norm_a, norm_b):.2e}; "
        f"worst weight {worst_w} {float((w_a[worst_w] - w_b[worst_w]).abs().max()):.2e}"
    )
    assert _worst(loss_a, loss_b) <= 1e-5, (loss_a, loss_b)
    assert _worst(norm_a, norm_b) <= norm_tol, (norm_a, norm_b)
    for k in w_a:
        torch.testing.assert_close(w_b[k], w_a[k], rtol=weights_tol, atol=weights_tol, msg=k)
    assert loss_a[-1] < loss_a[0]


def test_tp2_equals_one_process_on_image_batches(
    data: Path, tmp_path: Path, one_process: Callable[[int], Run]
) -> None:
    """TP 2 (sequence and loss parallel, MLA heads split, the MoE whole on both ranks; the
    tower and projector whole on both TP ranks), one sample a step: every second step has no
    image, so both ranks run the tower on zero patches."""
    argv = ["--training.local_batch_size", "1", "--parallelism.tensor_parallel_degree", "2"]
    got = _run(data, tmp_path, 2, argv)
    _assert_equal_runs(one_process(1), got, "kimi TP 2")


@pytest.mark.slow
def test_fsdp2_tp2_equals_one_process_on_image_batches(
    data: Path, tmp_path: Path, one_process: Callable[[int], Run]
) -> None:
    """FSDP 2 x TP 2, one sample per data-parallel rank a step: dp rank 1 never has an image,
    dp rank 0 always has one (the tower's FSDP units sharded over dp, replicated over tp)."""
    argv = ["--training.local_batch_size", "1", "--parallelism.tensor_parallel_degree", "2"]
    argv += ["--parallelism.data_parallel_shard_degree", "2"]
    got = _run(data, tmp_path, 4, argv)
    _assert_equal_runs(one_process(2), got, "kimi FSDP 2 x TP 2")


@pytest.mark.slow
def test_ep2_equals_one_process_on_image_batches(
    data: Path, tmp_path: Path, one_process: Callable[[int], Run]
) -> None:
    """Expert parallel 2 over FSDP 2 (the DeepSeek-V3 decoder's routed experts split between
    the ranks, the tower whole on each), one sample per rank a step, against one process with
    both samples (the MoE bounds of ``test_vlm_parallel.py``)."""
    argv = ["--training.local_batch_size", "1", "--parallelism.data_parallel_shard_degree", "2"]
    argv += ["--parallelism.expert_parallel_degree", "2"]
    got = _run(data, tmp_path, 2, argv)
    _assert_equal_runs(one_process(2), got, "kimi EP 2", weights_tol=2e-4, norm_tol=3e-3)


def _tiny_trained(mode: str, compiled: bool) -> tuple[list[float], torch.nn.Module]:
    """A tiny ``kimi_k25`` through ``distributed/parallelize.py`` (one process) with AC
    ``mode`` and compile, then 4 AdamW steps: three images, text only, three images, one image
    (the tower sees 0 to 3 images and 0 to 60 patches). Returns the losses and the model."""
    from tests.tiny_args import tiny_kimi_k25
    from tests.unit.test_kimi_k25 import GRIDS, _pixels, _tokens
    from torchtitan.config.job_config import JobConfig
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.distributed.parallelize import parallelize
    from torchtitan.models import MODELS

    cfg = JobConfig()
    cfg.activation_checkpoint.mode = mode  # type: ignore[assignment]
    cfg.compile.enable = compiled
    spec, args = MODELS["kimi_k25"], tiny_kimi_k25()
    model = spec.build(args)
    model.init_weights(seed=0)
    dims = ParallelDims.from_config(cfg.parallelism, 1)
    model = parallelize(model, spec.parallel_plan(args), dims, cfg, torch.float32, torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens, pixels = _tokens(), _pixels()
    text = torch.randint(0, 240, (2, 32), generator=torch.Generator().manual_seed(2))
    one = tokens.clone()
    one[0] = text[0]  # row 1 keeps image 2 only
    batches = [(tokens, pixels, GRIDS), (text, None, None), (tokens, pixels, GRIDS)]
    batches.append((one, pixels[-4:], GRIDS[-1:]))
    losses = []
    for toks, pix, grid in batches:
        logits = model(toks, pixel_values=pix, grid_thw=grid)
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), toks[:, 1:].flatten()
        )
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model


def test_activation_checkpointing_wraps_the_tower_blocks_and_changes_no_loss() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    plain, _ = _tiny_trained("none", False)
    full, model = _tiny_trained("full", False)
    assert all(isinstance(b, CheckpointWrapper) for b in model.vision_tower.encoder.blocks)
    assert all(isinstance(b, CheckpointWrapper) for b in model.layers.values())
    print("AC none:", plain, "full:", full)
    assert all(abs(a - b) <= 1e-6 * abs(a) for a, b in zip(plain, full, strict=True))
    assert plain[-1] != plain[0]


@pytest.mark.slow
def test_compile_compiles_the_tower_blocks_and_matches_eager() -> None:
    """Inductor on CPU: the MoonViT blocks compiled, losses within 1e-5 of eager over batches
    of 0, 1 and 3 images; with full AC as well."""
    eager, _ = _tiny_trained("none", False)
    for mode in ("none", "full"):
        compiled, model = _tiny_trained(mode, True)
        for block in [*model.vision_tower.encoder.blocks, *model.layers.values()]:
            assert hasattr(block.__dict__.get("forward"), "_torchdynamo_orig_callable")
        print(f"eager: {eager} compiled (AC {mode}): {compiled}")
        assert all(abs(a - b) <= 1e-5 * abs(a) for a, b in zip(eager, compiled, strict=True))


def _tp_grads() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], list[str]]:
    """One forward/backward of a tiny ``kimi_k25`` on an image batch, on this rank under TP 2
    (loss parallel) and as one process: every gradient (whole), the local gradients of the
    tower and projector, their gradients' placements."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    from tests.tiny_args import tiny_kimi_k25
    from tests.unit.test_kimi_k25 import GRIDS, _pixels, _tokens
    from torchtitan.distributed.tensor_parallel import apply_tp
    from torchtitan.models import MODELS

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    spec, args = MODELS["kimi_k25"], tiny_kimi_k25()
    tokens = _tokens()
    labels = tokens.roll(-1, dims=1)
    ref = spec.build(args)
    with torch.device("meta"):  # as the trainer: built on meta, parallelized, materialized
        model = spec.build(args)
    plan = spec.parallel_plan(args)
    apply_tp(model, plan.blocks_of(model), mesh, plan.tensor_parallel, loss_parallel=True)
    model.to_empty(device="cpu")
    for m in (ref, model):
        m.init_weights(seed=0, buffer_device="cpu")
    logits = ref(tokens, pixel_values=_pixels(), grid_thw=GRIDS)
    F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    logits = model(tokens, pixel_values=_pixels(), grid_thw=GRIDS)
    with loss_parallel():
        F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    whole, tower, placements = {}, {}, []
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        g, q = p.grad, ref_params[name]
        if q.grad is None:  # an expert no token chose (the same in both)
            assert g is None or not bool(g.full_tensor().any()), name
            continue
        assert g is not None, name
        if name.startswith(("vision_tower.", "mm_projector.")):
            assert isinstance(g, DTensor)
            placements.append(str(g.placements))
            tower[name] = g.to_local().numpy().copy()
        full = g.full_tensor() if isinstance(g, DTensor) else g
        whole[name] = np.stack([full.numpy(), q.grad.numpy()])
    return whole, tower, placements


@pytest.mark.slow
def test_tp2_tower_gradients_equal_on_both_ranks_and_one_process() -> None:
    """Under TP 2 the tower's and projector's gradients are replicated DTensors, bitwise equal
    on both TP ranks; every gradient of the model within 1e-5 (relative to its largest entry)
    of one process's."""
    (whole, tower0, placements), (_, tower1, _) = run_ranks(_tp_grads, 2)
    assert placements and set(placements) == {"(Replicate(),)"}
    assert all(np.array_equal(tower0[k], tower1[k]) for k in tower0)
    assert any(k.startswith("mm_projector.") for k in tower0)
    for name, (tp, one) in whole.items():
        scale = max(float(np.abs(one).max()), 1e-12)
        assert float(np.abs(tp - one).max()) <= 1e-5 * scale, name


IMAGE = 250  # tiny_kimi_k25's placeholder


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Four rows of 32 tokens: row 0 one image (tokens 3-8), row 1 none, row 2 two images
    (10-17, 20), row 3 one image (20-27); under CP 2 (chunks of 8 tokens: rank 0 holds 0-7 and
    24-31, rank 1 8-23) row 0's and row 3's images cross the boundary between the ranks."""
    tokens = torch.randint(0, 240, (4, 32), generator=torch.Generator().manual_seed(0))
    tokens[0, 3:9] = IMAGE
    tokens[2, 10:18] = IMAGE
    tokens[2, 20] = IMAGE
    tokens[3, 20:28] = IMAGE
    grids = torch.tensor([[1, 4, 6], [1, 8, 4], [1, 2, 2], [1, 4, 8]])  # 6, 8, 1, 8 tokens
    pixels = torch.randn(int(grids.prod(-1).sum()), 48, generator=torch.Generator().manual_seed(1))
    return tokens, pixels, grids


def _tiny() -> Any:
    from tests.tiny_args import tiny_kimi_k25
    from torchtitan.models import MODELS

    model = MODELS["kimi_k25"].build(tiny_kimi_k25())
    model.init_weights(seed=0)
    return model


def test_pipeline_microbatches_get_their_samples_images() -> None:
    """torch's splitter (the schedule's) cuts the per-sample inputs into 4 microbatches of one
    row: each holds exactly its row's patches and grids (row 1 none: the tower runs on zero
    patches), and each microbatch's logits equal that row of the whole batch's forward on the
    collated images (1e-5)."""
    from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks

    model = _tiny()
    tokens, pixels, grids = _batch()
    whole = model(tokens, pixel_values=pixels, grid_thw=grids)
    extra = model.image_inputs(tokens, pixels, grids)
    args, kwargs = split_args_kwargs_into_chunks((tokens,), extra, 4)
    images = [pixels[:24], pixels[24:24], pixels[24:60], pixels[60:]]
    row_grids = [grids[:1], grids[:0], grids[1:3], grids[3:]]
    for row, ((mb_tokens,), mb) in enumerate(zip(args, kwargs, strict=True)):
        size = mb["grid_thw"].prod(-1)
        assert torch.equal(mb["grid_thw"][size > 0], row_grids[row])
        n = int(size.sum())
        assert torch.equal(mb["pixel_values"][0, :n], images[row])
        assert not bool(mb["pixel_values"][0, n:].any())  # the padding
        logits = model(mb_tokens, **mb)
        torch.testing.assert_close(logits, whole[row : row + 1], rtol=1e-5, atol=1e-5)


class _CPMesh:
    """The two things ``ContextParallel`` reads of a cp mesh (no process group here)."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def get_local_rank(self) -> int:
        return self._rank


def test_cp_shards_get_their_image_tokens() -> None:
    """CP 2 head-tail (the collated patches, per-sample grids): each rank's share keeps the
    images whole, and its embeddings equal the whole sequence's at its token positions, exactly,
    with images crossing the shard boundary; the gradient reaches the projector on both
    ranks."""
    from torchtitan.distributed.context_parallel import ContextParallel
    from torchtitan.models import MODELS

    model = _tiny()
    tokens, pixels, grids = _batch()
    extra = model.image_inputs(tokens, pixels, grids, microbatched=False)
    assert extra["pixel_values"] is pixels
    whole = model._embed(tokens, pixels, grids, None)
    plan = MODELS["kimi_k25"].parallel_plan(model.args).context_parallel
    assert plan is not None
    for rank in (0, 1):
        mesh = _CPMesh(2, rank)
        cp = ContextParallel(mesh, "allgather", [model], whole_inputs=plan.whole_inputs)  # type: ignore[arg-type]
        local, _, sharded = cp.shard(tokens, tokens, extra)
        where = [*range(0, 8), *range(24, 32)] if rank == 0 else list(range(8, 24))
        assert torch.equal(local, tokens[:, where])
        assert torch.equal(sharded["grid_thw"], extra["grid_thw"])
        h = model._embed(
            local, sharded["pixel_values"], sharded["grid_thw"], sharded["visual_index"]
        )
        assert torch.equal(h, whole[:, where])
        model.zero_grad()
        h.sum().backward()
        grad = model.mm_projector.proj[2].weight.grad
        assert grad is not None and bool(grad.any())


PP_CP_LR = ["--optimizer.lr", "2e-4"]  # test_vlm_pp_cp.py's (its reasons)
PP2 = ["--parallelism.pipeline_parallel_degree", "2"]
PP2 += ["--parallelism.pipeline_parallel_microbatch_size", "1"]


def _compare(
    folder: Path, steps: int, batch: int, layout: list[str], label: str, world: int = 2
) -> None:
    """One process vs ``layout`` on ``world`` ranks, ``steps`` steps of ``batch`` samples:
    losses within 1e-5 relative, grad norms within 5e-4 (as ``test_vlm_pp_cp.py``)."""
    from tests.parity import assert_losses_match

    data = ["--training.dataset_path", str(folder / "data" / "vlm.parquet")]
    base = [*KIMI, *data, *FP32, *PP_CP_LR, "--training.steps", str(steps)]
    base += ["--training.local_batch_size", str(batch)]
    (one,) = run_ranks(_train, 1, base, str(folder / "one"), timeout=900.0)
    got = run_ranks(_train, world, [*base, *layout], str(folder / "run"), timeout=900.0)[0]
    a, b = [r["loss"] for r in one], [r["loss"] for r in got]
    print(label, "one process:", a, "layout:", b)
    assert len(a) == steps
    assert_losses_match(a, b, 1e-5, label)
    for x, y in zip(one, got, strict=True):
        assert abs(x["grad_norm"] - y["grad_norm"]) <= 5e-4 * abs(x["grad_norm"]), (x, y)
    assert a[-1] < a[0]


def test_pp2_small_equals_one_process_on_image_batches(tmp_path: Path) -> None:
    """The fast tier's PP case: PP 2 1F1B, 3 steps of 2 samples in 2 microbatches (the tower
    and projector on stage 0; step 2's second sample is text only)."""
    make_vlm_data.write(tmp_path / "data", 8, 4, False, 400, text_only_every=4)
    layout = [*PP2, "--parallelism.pipeline_parallel_schedule", "1F1B"]
    _compare(tmp_path, 3, 2, layout, "kimi PP 2 1F1B (3 steps)")


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1F1B", "GPipe"])
def test_pp2_equals_one_process_on_image_batches(tmp_path: Path, schedule: str) -> None:
    """PP 2, 10 steps of 4 microbatches of one sample (16 samples, every 4th text only)."""
    make_vlm_data.write(tmp_path / "data", 16, 4, False, 400, text_only_every=4)
    layout = [*PP2, "--parallelism.pipeline_parallel_schedule", schedule]
    _compare(tmp_path, STEPS, 4, layout, f"kimi PP 2 {schedule}")


@pytest.mark.slow
def test_cp2_equals_one_process_on_image_batches(tmp_path: Path) -> None:
    """CP 2 (all-gather, head-tail), 10 steps of 4 samples at seq 256; the tower and projector
    run on the whole batch's images on both ranks (``test_cp_shards_get_their_image_tokens``
    checks images that cross the shard boundary)."""
    make_vlm_data.write(tmp_path / "data", 16, 4, False, 400, text_only_every=4)
    layout = ["--parallelism.context_parallel_degree", "2"]
    _compare(tmp_path, STEPS, 4, layout, "kimi CP 2")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("extra", "label"),
    [
        ([*PP2, "--parallelism.pipeline_parallel_schedule", "1F1B"], "TP 2 x PP 2"),
        (["--parallelism.context_parallel_degree", "2"], "TP 2 x CP 2"),
    ],
    ids=["tp2_pp2", "tp2_cp2"],
)
def test_tp_with_pipeline_or_context_parallel_equals_one_process(
    extra: list[str], label: str, data: Path, tmp_path: Path, one_process: Callable[[int], Run]
) -> None:
    """TP 2 composed with PP 2 (1F1B, two microbatches of one sample; the tower, projector and
    scatter on the first stage) or CP 2 (every cp rank encodes the batch's images), two
    samples a step, 4 ranks, against one process with the TP tests' bounds."""
    argv = ["--training.local_batch_size", "2", "--parallelism.tensor_parallel_degree", "2"]
    got = _run(data, tmp_path, 4, [*argv, *extra])
    _assert_equal_runs(one_process(2), got, f"kimi {label}")


FSDP2 = ["--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "2"]
"""FSDP 2 with the reference's global batch of 4 (the later flag wins over ``_compare``'s)."""
CP2 = ["--parallelism.context_parallel_degree", "2"]
COMPOSED = {
    "PP 2 x CP 2": [*PP2, "--parallelism.pipeline_parallel_schedule", "1F1B", *CP2],
    "FSDP 2 x CP 2": [*FSDP2, *CP2],
    "PP 2 x FSDP 2": [*PP2, "--parallelism.pipeline_parallel_schedule", "1F1B", *FSDP2],
    "PP 2 Interleaved1F1B": [*PP2, "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"],
}


@pytest.mark.slow
@pytest.mark.parametrize("label", sorted(COMPOSED))
def test_composed_layouts_equal_one_process_on_image_batches(tmp_path: Path, label: str) -> None:
    """PP and CP composed with each other and with FSDP, and an interleaved schedule (4
    stages, 2 per rank: rank 0 holds stage 0 with the tower), 10 steps of 4 samples."""
    make_vlm_data.write(tmp_path / "data", 16, 4, False, 400, text_only_every=4)
    world = 4 if label.count(" x ") else 2
    _compare(tmp_path, STEPS, 4, COMPOSED[label], f"kimi {label}", world=world)
