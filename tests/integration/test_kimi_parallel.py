"""Kimi K2.5 beyond data parallel (docs/vlm.md, "Kimi K2.5"): activation checkpointing and
compile of the MoonViT blocks (``extra_blocks``) change no loss; under tensor parallel (alone and
with FSDP) the tower and projector run whole on every TP rank and 10 steps of image batches
through the trainer equal one process (losses within 1e-5 relative; the reported gradient norms
and the final weights within the bounds ``tests/integration/test_vlm_parallel.py`` uses for
qwen3_5_vl); the tower's gradients are equal on both TP ranks.

The data (``scripts/make_vlm_data.py``, 8 samples) has an image in the even samples only, so a
one-sample batch has no image every second step (the tower and projector then run on zero
patches on both TP ranks).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

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
