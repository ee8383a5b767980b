"""Image-text data for Kimi K2.5 (``data/vlm_images.py: NavitRules``; docs/vlm.md, "Kimi K2.5"): the sizes
and the patch order of transformers' ``Kimi_K25ImageProcessor``, the placeholders and patches
of the dataset with these rules, and training through the trainer on image batches.

transformers' processor itself needs torchvision, which this environment does not have: its
two torchvision-free functions (``navit_resize``, ``patchify``) are read from the installed
file and run here as they are."""

from __future__ import annotations

import ast
import io
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.parity import DEBUG_TOML, ROOT, read_jsonl
from torchtitan.data.tokenizer import build_tokenizer
from torchtitan.data.vlm_dataset import ImageTokens, VLMDataset
from torchtitan.data.vlm_images import NavitRules, navit_size
from torchtitan.loss.chunked import IGNORE_INDEX

sys.path.insert(0, str(ROOT / "scripts"))
import make_vlm_data  # noqa: E402

TOKENIZER = ROOT / "tests/assets/tokenizer"
IMAGE_ID = 2047  # the debug flavor's placeholder


def _reference(name: str) -> Any:
    """``name`` (a function or a method) of transformers' Kimi image processor module, compiled
    from the installed source on its own."""
    transformers = pytest.importorskip("transformers")
    path = Path(transformers.__file__).parent / "models/kimi_k25/image_processing_kimi_k25.py"
    tree = ast.parse(path.read_text())
    nodes = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name]
    namespace: dict[str, Any] = {"math": math, "torch": torch}
    exec(compile(ast.Module(body=nodes[:1], type_ignores=[]), str(path), "exec"), namespace)
    return namespace[name]


@pytest.mark.parametrize("max_patches", [16384, 64])
def test_sizes_equal_transformers_navit_resize(max_patches: int) -> None:
    reference = _reference("navit_resize")
    sides = [1, 5, 13, 14, 27, 28, 29, 100, 333, 1000, 7169, 9000]
    for h in sides:
        for w in sides:
            ours = navit_size(h, w, 14, 2, max_patches, 512)
            assert ours == reference(h, w, 14, 2, max_patches, 512), (h, w)


def _png(rgb: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("size", [(37, 53), (8, 8), (64, 24)])
def test_patches_equal_transformers_order_and_padding(size: tuple[int, int]) -> None:
    """An image the processor does not resize: padded black at the bottom and the right to
    multiples of 8 (4-pixel patches, 2 x 2 merge), normalized, cut in raster order by the
    reference's ``patchify``."""
    rules = NavitRules(patch_size=4, merge_size=2)
    rgb = np.random.default_rng(sum(size)).integers(0, 255, (*size, 3), dtype=np.uint8)
    pixels, grid = rules.encode(_png(rgb))
    (h, w), (ph, pw) = navit_size(*size, 4, 2, rules.max_patches, rules.max_side)
    assert (h, w) == size and grid == (1, ph // 4, pw // 4)
    padded = np.zeros((ph, pw, 3), dtype=np.float32)
    padded[:h, :w] = rgb / 255.0
    image = torch.from_numpy((padded - 0.5) / 0.5).permute(2, 0, 1)[None]
    ref, gh, gw = _reference("patchify")(None, image, 4)
    assert (1, gh, gw) == grid
    assert torch.allclose(pixels, ref.reshape(gh * gw, -1), atol=1e-6, rtol=0)


def test_large_images_shrink_within_the_patch_budget() -> None:
    rules = NavitRules(patch_size=4, merge_size=2, max_patches=64, max_side=12)
    rgb = np.full((100, 30, 3), 200, dtype=np.uint8)
    pixels, (t, gh, gw) = rules.encode(_png(rgb))
    assert gh <= 12 + 1 and gh * gw <= 64 + 2 * (gh + gw) and pixels.shape == (gh * gw, 48)
    assert navit_size(100, 30, 4, 2, 64, 12) == ((48, 14), (48, 16))


def test_dataset_places_one_placeholder_per_merged_token(tmp_path: Path) -> None:
    """With the Kimi rules (14-pixel patches, black padding): ``h * w / 4`` placeholders per
    image, ``[N, 3 * 14 * 14]`` patches, labels never targeting a placeholder."""
    make_vlm_data.write(tmp_path, 4, seed=1, bad=False, oversized=400)
    data = VLMDataset(
        [tmp_path / "vlm.parquet"], build_tokenizer(TOKENIZER), 128, NavitRules(),
        ImageTokens(IMAGE_ID),
    )  # fmt: skip
    samples = list(data)
    assert len(samples) == 4
    for s in samples:
        patches = int(s.grid_thw.prod(-1).sum())
        assert int((s.inputs == IMAGE_ID).sum()) == patches // 4
        assert s.pixel_values.shape == (patches, 3 * 14 * 14)
        assert bool((s.grid_thw[:, 1:] % 2 == 0).all())
        assert not bool((s.labels == IMAGE_ID).any())
        assert bool((s.labels != IGNORE_INDEX).any())


def _train(argv: list[str], dump: str) -> list[dict]:
    from torchtitan.train import main

    rc = main(["--job.config_file", DEBUG_TOML, "--job.dump_folder", dump, *argv])
    assert rc == 0, f"train exited {rc}"
    return read_jsonl(Path(dump) / "metrics" / "rank_0.jsonl")


def test_trainer_runs_kimi_on_image_batches(tmp_path: Path) -> None:
    """``--model.name kimi_k25 --training.dataset vlm``: four steps of the debug flavor through
    the trainer on image-text samples (the Kimi processor rules, 14-pixel patches), fp32; the
    loss falls."""
    from tests.launcher import run_ranks

    make_vlm_data.write(tmp_path / "data", 4, 7, False, 400)
    argv = ["--model.name", "kimi_k25", "--training.dataset", "vlm"]
    argv += ["--training.dataset_path", str(tmp_path / "data" / "vlm.parquet")]
    argv += ["--training.mixed_precision_param", "float32", "--metrics.log_freq", "1"]
    argv += ["--metrics.no-enable_tensorboard", "--checkpoint.no-enable", "--validation.no-enable"]
    argv += ["--training.seq_len", "128", "--lr_scheduler.warmup_steps", "2"]
    argv += ["--training.steps", "4", "--training.local_batch_size", "2"]
    (records,) = run_ranks(_train, 1, argv, str(tmp_path / "run"), timeout=600.0)
    losses = [r["loss"] for r in records]
    print("kimi_k25 debugmodel losses:", losses)
    assert len(losses) == 4 and losses[-1] < losses[0], losses


@pytest.mark.slow
def test_fsdp2_equals_one_process_on_image_batches(tmp_path: Path) -> None:
    """Four steps on 8 samples, global batch 2: one process vs FSDP 2 (the tower blocks, the
    tower and the projector their own FSDP units): losses within 1e-5 relative. Samples 3 and
    7 have no image, so rank 1 runs the tower on zero patches at steps 2 and 4."""
    from tests.launcher import run_ranks

    make_vlm_data.write(tmp_path / "data", 8, 4, False, 400, text_only_every=4)
    argv = ["--model.name", "kimi_k25", "--training.dataset", "vlm"]
    argv += ["--training.dataset_path", str(tmp_path / "data" / "vlm.parquet")]
    argv += ["--training.mixed_precision_param", "float32", "--metrics.log_freq", "1"]
    argv += ["--metrics.no-enable_tensorboard", "--checkpoint.no-enable", "--validation.no-enable"]
    argv += ["--training.seq_len", "128", "--lr_scheduler.warmup_steps", "2"]
    argv += ["--training.steps", "4"]
    one_argv = [*argv, "--training.local_batch_size", "2"]
    (one,) = run_ranks(_train, 1, one_argv, str(tmp_path / "one"), timeout=900.0)
    fsdp = [*argv, "--training.local_batch_size", "1", "--parallelism.data_parallel_shard_degree"]
    two = run_ranks(_train, 2, [*fsdp, "2"], str(tmp_path / "two"), timeout=900.0)[0]
    a, b = [r["loss"] for r in one], [r["loss"] for r in two]
    print("one process:", a, "FSDP 2:", b)
    assert len(a) == len(b) == 4
    assert all(abs(x - y) <= 1e-5 * abs(x) for x, y in zip(a, b, strict=True)), (a, b)
