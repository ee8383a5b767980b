"""Vision-language training through the trainer (``--model.name qwen3_5_vl --training.dataset
vlm``; docs/vlm.md): the bad-config refusals (exit 2, one line) and, in the slow tier, FSDP 2
equal to one process over image batches."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.launcher import run_ranks
from tests.parity import DEBUG_TOML, ROOT, read_jsonl

sys.path.insert(0, str(ROOT / "scripts"))
import make_vlm_data  # noqa: E402

VLM = ["--model.name", "qwen3_5_vl", "--training.dataset", "vlm"]
FP32 = ["--training.mixed_precision_param", "float32", "--metrics.log_freq", "1"]
FP32 += ["--metrics.no-enable_tensorboard", "--checkpoint.no-enable", "--validation.no-enable"]
FP32 += ["--training.seq_len", "256", "--lr_scheduler.warmup_steps", "2"]


def _train(argv: list[str], dump: str) -> list[dict]:
    from torchtitan.train import main

    rc = main(["--job.config_file", DEBUG_TOML, "--job.dump_folder", dump, *argv])
    assert rc == 0, f"train exited {rc}"
    return read_jsonl(Path(dump) / "metrics" / "rank_0.jsonl")


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["--model.name", "qwen3_5", "--training.dataset", "vlm"], "training.dataset"),
        ([*VLM, "--training.dataset_path", "/nonexistent.parquet"], "training.dataset_path"),
    ],
    ids=["text-model", "missing-path"],
)
def test_bad_vlm_config_exits_2_with_one_line(
    argv: list[str], field: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from torchtitan.train import main

    rc = main(["--job.config_file", DEBUG_TOML, "--job.dump_folder", str(tmp_path), *argv])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if field in line]
    assert rc == 2 and len(lines) == 1, err


@pytest.mark.slow
def test_fsdp2_equals_one_process_on_image_batches(tmp_path: Path) -> None:
    """Four steps on 8 image-text samples, global batch 2: one process vs FSDP 2 (one sample
    per rank; sample i is rank i % 2's; the tower blocks and the tower their own FSDP units):
    losses within 1e-5 relative, and falling. Samples 3 and 7 have no image, so rank 1 runs
    the tower on zero patches at steps 2 and 4 while rank 0 encodes images."""
    make_vlm_data.write(tmp_path / "data", 8, 4, False, 400, text_only_every=4)
    data = ["--training.dataset_path", str(tmp_path / "data" / "vlm.parquet")]
    base = [*VLM, *data, *FP32, "--training.steps", "4"]
    (one,) = run_ranks(
        _train, 1, [*base, "--training.local_batch_size", "2"], str(tmp_path / "one"), timeout=900.0
    )
    fsdp = [*base, "--training.local_batch_size", "1"]
    fsdp += ["--parallelism.data_parallel_shard_degree", "2"]
    two = run_ranks(_train, 2, fsdp, str(tmp_path / "two"), timeout=900.0)[0]
    a, b = [r["loss"] for r in one], [r["loss"] for r in two]
    print("one process:", a, "FSDP 2:", b)
    assert len(a) == len(b) == 4
    assert all(abs(x - y) <= 1e-5 * abs(x) for x, y in zip(a, b, strict=True)), (a, b)
    assert a[-1] < a[0]


def test_missing_pillow_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without Pillow (an install without the vlm extra) image-text training is refused before
    any process group, naming the package and the extra."""
    import importlib.util

    from torchtitan.train import main

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "PIL" else real(name, *a)
    )
    argv = [*VLM, "--training.dataset_path", str(tmp_path)]
    rc = main(["--job.config_file", DEBUG_TOML, "--job.dump_folder", str(tmp_path), *argv])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "Pillow" in line]
    assert rc == 2 and len(lines) == 1 and "vlm extra" in lines[0], err
