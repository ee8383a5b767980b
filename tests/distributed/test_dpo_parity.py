"""DPO trains like one process (docs/posttrain.md; docs/architecture.md, promise 1): the debug
model built by the Trainer (its layouts, optimizer and schedule), trained by ``DpoStep`` on the
synthetic preference pairs of ``scripts/make_posttrain_data.py``, gives the single-process
losses and rewards (fp32, relative 1e-5) under FSDP 2 and TP 2; with LoRA (the reference being
the base with its adapters off, no copy) under FSDP 2 too."""

from __future__ import annotations

from pathlib import Path

import pytest

# Import the trainer in the parent so forked ranks start without re-importing it.
import torchtitan.training.trainer  # noqa: F401
from scripts.make_posttrain_data import write
from tests.launcher import run_ranks
from tests.parity import DEBUG_TOML, TINY

STEPS = 4
PAIRS = 4  # per step, global
LORA = [
    "--lora.enable",
    "--lora.rank",
    "4",
    "--lora.target_modules",
    "attention.w*,feed_forward.w*",
]


def _dpo_rank(argv: list[str], dump: str, data: str, loss_type: str) -> list[dict]:
    from torchtitan.distributed.utils import destroy_distributed
    from torchtitan.posttrain.dpo import DpoSettings, DpoStep
    from torchtitan.posttrain.losses import REFERENCE_FREE
    from torchtitan.posttrain.preference_data import PreferenceDataset, preference_batches
    from torchtitan.posttrain.reference import Reference
    from torchtitan.preflight.validate import load_config
    from torchtitan.training.trainer import Trainer

    cfg = load_config(["--job.config_file", DEBUG_TOML, "--job.dump_folder", dump, *TINY, *argv])
    trainer = Trainer(cfg)
    try:
        dp = trainer.parallel_dims.get_mesh("dp")
        ds = PreferenceDataset(data, trainer.tokenizer, 32, dp.get_local_rank(), dp.size())
        parts = trainer.model_parts
        step = DpoStep(
            parts, trainer.optimizer, trainer.lr_scheduler, DpoSettings(loss_type, beta=0.5),
            None if loss_type in REFERENCE_FREE else Reference(parts), dp, trainer.device,
        )  # fmt: skip
        batches = preference_batches(ds, PAIRS // dp.size())
        return [step.run([next(batches)]) for _ in range(STEPS)]
    finally:
        trainer.close()
        destroy_distributed()


def _run(tmp: Path, world: int, argv: list[str], loss_type: str = "sigmoid") -> list[dict]:
    data = tmp / "data"
    if not data.exists():
        write(data, 32, 0, 9)
    dump = tmp / f"dump_{world}_{len(argv)}"
    argv = [
        "--training.steps",
        str(STEPS),
        "--optimizer.lr",
        "1e-2",
        "--training.local_batch_size",
        str(8 // world),
        *argv,
    ]
    return run_ranks(_dpo_rank, world, argv, str(dump), str(data / "preference.jsonl"), loss_type)[
        0
    ]


def _match(ref: list[dict], got: list[dict], label: str) -> None:
    for i, (a, b) in enumerate(zip(ref, got, strict=True)):
        for k in ("loss", "rewards/chosen", "rewards/margins"):
            assert abs(a[k] - b[k]) <= 1e-5 * max(1.0, abs(a[k])), (label, i, k, a[k], b[k])
    assert ref[-1]["loss"] != ref[0]["loss"]


def test_dpo_fsdp2_equals_one_process(tmp_path: Path) -> None:
    one = _run(tmp_path, 1, [])
    _match(one, _run(tmp_path, 2, ["--parallelism.data_parallel_shard_degree", "2"]), "fsdp2")


@pytest.mark.slow
def test_dpo_tp2_equals_one_process(tmp_path: Path) -> None:
    one = _run(tmp_path, 1, [])
    tp = [
        "--parallelism.data_parallel_shard_degree",
        "1",
        "--parallelism.tensor_parallel_degree",
        "2",
    ]
    _match(one, _run(tmp_path, 2, tp), "tp2")


@pytest.mark.slow
def test_dpo_lora_fsdp2_equals_one_process(tmp_path: Path) -> None:
    one = _run(tmp_path, 1, LORA)
    _match(
        one,
        _run(tmp_path, 2, [*LORA, "--parallelism.data_parallel_shard_degree", "2"]),
        "lora fsdp2",
    )


@pytest.mark.slow
def test_simpo_fsdp2_equals_one_process(tmp_path: Path) -> None:
    one = _run(tmp_path, 1, [], "simpo")
    _match(
        one, _run(tmp_path, 2, ["--parallelism.data_parallel_shard_degree", "2"], "simpo"), "simpo"
    )
