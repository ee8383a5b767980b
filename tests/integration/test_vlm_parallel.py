"""Qwen3.5 with vision under tensor parallel (alone, with FSDP, PP or CP), HSDP and DDP
(docs/vlm.md, "Parallelism"): each layout trains 10 steps on image batches through the trainer and equals one
process (losses within 1e-5 relative; the final weights and the reported gradient norms within
measured bounds, ``_assert_equal_runs``); under TP 2 the tower's gradients are equal on both
ranks; activation checkpointing and compile wrap the tower's blocks too, float8 leaves them.

The data (``scripts/make_vlm_data.py``, 8 samples) has an image in the even samples only, so a
one-sample batch (TP 2 with local batch 1) has no image every second step and, with two
data-parallel ranks, rank 1 never encodes one (its tower runs on zero patches every step).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.checkpoint_helpers import read_checkpoint
from tests.integration.test_vlm_run import FP32, VLM, _train
from tests.launcher import run_ranks
from tests.parity import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import make_vlm_data  # noqa: E402

STEPS = 10
EXPORT = ["--checkpoint.enable", "--checkpoint.interval", str(STEPS)]
EXPORT += ["--checkpoint.last_save_model_only"]  # the final weights, model only
LR = ["--optimizer.lr", "3e-4"]

Run = tuple[list[float], list[float], dict[str, torch.Tensor]]
"""Per-step losses, per-step gradient norms, the final weights."""


def _run(data: Path, dump: Path, ranks: int, argv: list[str]) -> Run:
    base = [*VLM, "--training.dataset_path", str(data), *FP32, *EXPORT, *LR]
    base += ["--training.steps", str(STEPS)]
    metrics = run_ranks(_train, ranks, [*base, *argv], str(dump), timeout=900.0)[0]
    weights = read_checkpoint(dump / "checkpoint" / f"step-{STEPS}")
    tensors = {k: v for k, v in weights.items() if isinstance(v, torch.Tensor)}
    return [m["loss"] for m in metrics], [m["grad_norm"] for m in metrics], tensors


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("vlm_data")
    make_vlm_data.write(folder, 8, 4, False, 400, text_only_every=2)
    return folder / "vlm.parquet"


@pytest.fixture(scope="module")
def one_process(data: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, int], Run]:
    """The one-process run of a flavor at a local batch size (each made once per module)."""
    runs: dict[tuple[str, int], Run] = {}

    def get(flavor: str, batch: int) -> Run:
        if (flavor, batch) not in runs:
            dump = tmp_path_factory.mktemp(f"one_{flavor}_{batch}")
            argv = ["--model.flavor", flavor, "--training.local_batch_size", str(batch)]
            runs[flavor, batch] = _run(data, dump, 1, argv)
        return runs[flavor, batch]

    return get


def _worst(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(x) for x, y in zip(a, b, strict=True))


def _assert_equal_runs(
    ref: Run, got: Run, label: str, weights_tol: float = 3e-5, norm_tol: float = 5e-4
) -> None:
    """Losses within 1e-5 relative; every final weight within ``weights_tol`` (relative and
    absolute; measured up to 1.7e-5 for dense: AdamW's normalized steps carry last-bit gradient
    differences into the weights); gradient norms within ``norm_tol`` relative (the norm the
    trainer reports differs from one process's by up to 2.3e-4 here, 9e-5 under HSDP, which has
    no TP, and 6e-5 for the text-only decoder under TP 2: docs/vlm.md, "Parallelism")."""
    (loss_a, norm_a, w_a), (loss_b, norm_b, w_b) = ref, got
    assert len(loss_a) == len(loss_b) == STEPS
    assert set(w_a) == set(w_b) and any(k.startswith("model.visual.") for k in w_a)
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
    data: Path, tmp_path: Path, one_process: Callable[[str, int], Run]
) -> None:
    """TP 2 (sequence and loss parallel; the tower whole on both TP ranks), one sample a step:
    every second step has no image, so both ranks run the tower on zero patches."""
    argv = ["--training.local_batch_size", "1", "--parallelism.tensor_parallel_degree", "2"]
    got = _run(data, tmp_path, 2, argv)
    _assert_equal_runs(one_process("debugmodel", 1), got, "TP 2")


@pytest.mark.slow
def test_tp2_moe_equals_one_process_on_image_batches(
    data: Path, tmp_path: Path, one_process: Callable[[str, int], Run]
) -> None:
    """The MoE flavor (experts whole on both TP ranks), one sample a step."""
    argv = ["--model.flavor", "debugmodel_moe", "--training.local_batch_size", "1"]
    argv += ["--parallelism.tensor_parallel_degree", "2"]
    got = _run(data, tmp_path, 2, argv)
    # Looser on the weights and norms than dense (measured 4.5e-5 and 1.1e-3; losses 6e-6;
    # the suspected amplifier, not verified: top-k routing of a near-tied token).
    ref = one_process("debugmodel_moe", 1)
    _assert_equal_runs(ref, got, "TP 2 MoE", weights_tol=2e-4, norm_tol=3e-3)


@pytest.mark.slow
def test_ep2_moe_equals_one_process_on_image_batches(
    data: Path, tmp_path: Path, one_process: Callable[[str, int], Run]
) -> None:
    """The MoE flavor under expert parallel 2 over FSDP 2 (each rank one sample a step, the
    experts split between the ranks, the tower whole on each), against one process with both
    samples."""
    argv = ["--model.flavor", "debugmodel_moe", "--training.local_batch_size", "1"]
    argv += ["--parallelism.data_parallel_shard_degree", "2"]
    argv += ["--parallelism.expert_parallel_degree", "2"]
    got = _run(data, tmp_path, 2, argv)
    ref = one_process("debugmodel_moe", 2)
    _assert_equal_runs(ref, got, "EP 2 MoE", weights_tol=2e-4, norm_tol=3e-3)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("degrees", "label"),
    [
        ({"data_parallel_shard_degree": 2, "tensor_parallel_degree": 2}, "FSDP 2 x TP 2"),
        ({"data_parallel_replicate_degree": 2, "data_parallel_shard_degree": 2}, "HSDP 2 x 2"),
        ({"data_parallel_replicate_degree": 2, "data_parallel_shard_degree": 1}, "DDP 2"),
    ],
    ids=["fsdp2_tp2", "hsdp2x2", "ddp2"],
)
def test_data_parallel_layouts_equal_one_process_on_image_batches(
    degrees: dict[str, int],
    label: str,
    data: Path,
    tmp_path: Path,
    one_process: Callable[[str, int], Run],
) -> None:
    """One sample per data-parallel rank a step: data-parallel rank 1 (and 3) never has an
    image, rank 0 (and 2) always has one."""
    dp = degrees.get("data_parallel_replicate_degree", 1) * degrees["data_parallel_shard_degree"]
    ranks = dp * degrees.get("tensor_parallel_degree", 1)
    argv = ["--training.local_batch_size", "1"]
    for name, degree in degrees.items():
        argv += [f"--parallelism.{name}", str(degree)]
    got = _run(data, tmp_path, ranks, argv)
    _assert_equal_runs(one_process("debugmodel", dp), got, label)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("degrees", "label"),
    [
        ({"pipeline_parallel_degree": 2}, "TP 2 x PP 2"),
        ({"context_parallel_degree": 2}, "TP 2 x CP 2"),
    ],
    ids=["tp2_pp2", "tp2_cp2"],
)
def test_tp_with_pipeline_or_context_parallel_equals_one_process(
    degrees: dict[str, int],
    label: str,
    data: Path,
    tmp_path: Path,
    one_process: Callable[[str, int], Run],
) -> None:
    """TP 2 composed with PP 2 (1F1B, two microbatches of one sample; the tower and the scatter
    on the first stage) or CP 2 (every cp rank encodes the batch's images), two samples a
    step."""
    argv = ["--training.local_batch_size", "2", "--parallelism.tensor_parallel_degree", "2"]
    for name, degree in degrees.items():
        argv += [f"--parallelism.{name}", str(degree)]
    if "pipeline_parallel_degree" in degrees:
        argv += ["--parallelism.pipeline_parallel_schedule", "1F1B"]
    got = _run(data, tmp_path, 4, argv)
    _assert_equal_runs(one_process("debugmodel", 2), got, label)


def _tiny_trained(mode: str, compiled: bool) -> tuple[list[float], torch.nn.Module]:
    """A tiny ``qwen3_5_vl`` through ``distributed/parallelize.py`` (one process) with AC
    ``mode`` and compile, then 4 AdamW steps: three images, text only, three images, one image
    (the tower sees 0 to 3 images and 0 to 96 patches). Returns the losses and the model."""
    from tests.tiny_args import tiny_qwen3_5_vl
    from tests.unit.test_qwen3_5_vl import GRIDS, _pixels, _tokens
    from torchtitan.config.job_config import JobConfig
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.distributed.parallelize import parallelize
    from torchtitan.models import MODELS

    cfg = JobConfig()
    cfg.activation_checkpoint.mode = mode  # type: ignore[assignment]
    cfg.compile.enable = compiled
    spec, args = MODELS["qwen3_5_vl"], tiny_qwen3_5_vl()
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
    assert all(isinstance(b, CheckpointWrapper) for b in model.visual.blocks)
    assert all(isinstance(b, CheckpointWrapper) for b in model.layers.values())
    print("AC none:", plain, "full:", full)
    assert all(abs(a - b) <= 1e-6 * abs(a) for a, b in zip(plain, full, strict=True))


@pytest.mark.slow
def test_compile_compiles_the_tower_blocks_and_matches_eager() -> None:
    """Inductor on CPU: the tower's blocks compiled (its per-frame attention eager), losses
    within 1e-5 of eager over batches of 0, 1 and 3 images; with full AC as well."""
    eager, _ = _tiny_trained("none", False)
    for mode in ("none", "full"):
        compiled, model = _tiny_trained(mode, True)
        for block in [*model.visual.blocks, *model.layers.values()]:
            assert hasattr(block.__dict__.get("forward"), "_torchdynamo_orig_callable")
        print(f"eager: {eager} compiled (AC {mode}): {compiled}")
        assert all(abs(a - b) <= 1e-5 * abs(a) for a, b in zip(eager, compiled, strict=True))


def _tp_grads() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], list[str]]:
    """One forward/backward of a tiny ``qwen3_5_vl`` on an image batch, on this rank under TP 2
    (loss parallel) and as one process: every gradient (whole), the local gradients of the
    tower, the tower's gradient placements."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    from tests.tiny_args import tiny_qwen3_5_vl
    from tests.unit.test_qwen3_5_vl import GRIDS, _pixels, _tokens
    from torchtitan.distributed.tensor_parallel import apply_tp
    from torchtitan.models import MODELS

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    spec, args = MODELS["qwen3_5_vl"], tiny_qwen3_5_vl()
    tokens = _tokens()
    labels = tokens.roll(-1, dims=1)
    ref = spec.build(args)
    with torch.device("meta"):  # as the trainer: built on meta, parallelized, materialized
        model = spec.build(args)
    plan = spec.parallel_plan(args)
    apply_tp(model, plan.blocks_of(model), mesh, plan.tensor_parallel, loss_parallel=True)
    model.to_empty(device="cpu")  # (re-ties the tiny model's embedding and output)
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
        assert g is not None and q.grad is not None, name
        if name.startswith("visual."):
            assert isinstance(g, DTensor)
            placements.append(str(g.placements))
            tower[name] = g.to_local().numpy().copy()
        full = g.full_tensor() if isinstance(g, DTensor) else g
        whole[name] = np.stack([full.numpy(), q.grad.numpy()])
    return whole, tower, placements


@pytest.mark.slow
def test_tp2_tower_gradients_equal_on_both_ranks_and_one_process() -> None:
    """Under TP 2 the tower's gradients are replicated DTensors, bitwise equal on both TP
    ranks; every gradient of the model within 1e-5 (relative to its largest entry) of one
    process's."""
    (whole, tower0, placements), (_, tower1, _) = run_ranks(_tp_grads, 2)
    assert placements and set(placements) == {"(Replicate(),)"}
    assert all(np.array_equal(tower0[k], tower1[k]) for k in tower0)
    for name, (tp, one) in whole.items():
        scale = max(float(np.abs(one).max()), 1e-12)
        assert float(np.abs(tp - one).max()) <= 1e-5 * scale, name


def test_float8_leaves_the_tower_in_high_precision() -> None:
    """The tower computes with local weights (``tower.py: local``), which a ``Float8Linear``
    would not honour: float8 exempts the whole tower and still converts the decoder."""
    from tests.tiny_args import tiny_qwen3_5_vl
    from torchtitan.distributed.float8 import apply_float8
    from torchtitan.models import MODELS

    with torch.device("meta"):
        model = MODELS["qwen3_5_vl"].build(tiny_qwen3_5_vl())
    converted = apply_float8(model, auto_filter_small_kn=False, emulate=True, device_type="cpu")
    assert converted and not any(name.startswith("visual.") for name in converted), converted
