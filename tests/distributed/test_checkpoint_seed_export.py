"""Tier 3: model-only checkpoints. A seed checkpoint made on one process starts an FSDP 2 run,
and the last-step export (``last_save_model_only``) holds only the model in ``export_dtype``,
loads as initial weights and converts to Hugging Face."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

import torchtitan.train  # noqa: F401  (imported before the ranks fork, so they start fast)
from tests.checkpoint_helpers import ckpt_argv, read_checkpoint, train_with_faults
from tests.launcher import run_ranks
from tests.parity import DEBUG_TOML, assert_losses_match, losses, train_metrics
from tests.script_loader import load

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4
SEED_A, SEED_B = ["--debug.seed", "7"], ["--debug.seed", "11"]


def _manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def test_seed_checkpoint_starts_an_fsdp2_run(tmp_path: Path) -> None:
    """Seed made with seed A on one process; FSDP 2 with seed B loads it and must train exactly
    like one process with seed A (and not like seed B, which starts from other weights)."""
    dump = tmp_path / "run"
    seed_argv = [*ckpt_argv(*SEED_A, steps=STEPS), "--checkpoint.create_seed_checkpoint"]
    assert not run_ranks(train_with_faults, 1, seed_argv, str(dump))[0], "the seed run trained"
    seed = dump / "checkpoint" / "step-0"
    assert _manifest(seed)["kind"] == "seed"
    keys = read_checkpoint(seed)
    assert keys and all(k.startswith("model.") for k in keys), sorted(keys)[:5]

    fsdp = run_ranks(
        train_with_faults,
        2,
        ckpt_argv(*SEED_B, "--training.local_batch_size", "4", steps=STEPS, interval=100),
        str(dump),
    )[0]
    assert [m["step"] for m in fsdp] == list(range(1, STEPS + 1)), "did not start at step 1"
    one_a = train_metrics(["--training.local_batch_size", "8", *SEED_A], 1, tmp_path / "a", STEPS)
    one_b = train_metrics(["--training.local_batch_size", "8", *SEED_B], 1, tmp_path / "b", 1)
    assert_losses_match(losses(one_a), losses(fsdp), rtol=1e-5, label="seed A -> FSDP 2 seed B")
    gap = abs(losses(one_b)[0] - losses(fsdp)[0]) / losses(one_b)[0]
    print(f"step-1 loss: seed A {losses(one_a)[0]:.6f}, seed B {losses(one_b)[0]:.6f}")
    assert gap > 1e-4, "seed B alone gives the same loss: the test could not tell the seeds apart"


def _train_and_read_export(argv: list[str], dump: str) -> list[str]:
    """Train (FSDP 2); then rank 0 compares the step-STEPS export with the trained weights cast
    to bfloat16. Returns the mismatching names (tensors cannot travel back to the parent)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from torchtitan.checkpoint.storage import read_model_weights
    from torchtitan.preflight.validate import load_config
    from torchtitan.training.trainer import Trainer

    trainer = Trainer(
        load_config(["--job.config_file", DEBUG_TOML, "--job.dump_folder", dump, *argv])
    )
    try:
        trainer.train()
    finally:
        trainer.close()
    full: dict[str, Any] = dict(
        get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True))
    )
    bad: list[str] = []
    if dist.get_rank() == 0:
        export = read_model_weights(Path(dump) / "checkpoint" / f"step-{STEPS}")
        assert set(export) == set(full), set(export) ^ set(full)
        bad = [
            k
            for k, v in export.items()
            if v.dtype != torch.bfloat16 or not torch.equal(v, full[k].to(torch.bfloat16))
        ]
    dist.barrier()
    return bad


def test_last_save_model_only_exports_bf16_weights(tmp_path: Path) -> None:
    dump = tmp_path / "run"
    argv = ckpt_argv(
        "--training.local_batch_size",
        "4",
        "--checkpoint.last_save_model_only",
        "--checkpoint.export_dtype",
        "bfloat16",
        steps=STEPS,
        interval=2,
    )
    bad = run_ranks(_train_and_read_export, 2, argv, str(dump))[0]
    assert not bad, f"export differs from the trained weights cast to bf16: {bad[:5]}"
    root = dump / "checkpoint"
    export, interval = root / f"step-{STEPS}", root / "step-2"
    assert _manifest(export)["kind"] == "export" and _manifest(interval)["kind"] == "full"
    entries = read_checkpoint(export)
    assert all(k.startswith("model.") for k in entries), sorted(entries)[:5]
    dtypes = {v.dtype for v in entries.values() if v.is_floating_point()}
    assert dtypes == {torch.bfloat16}, dtypes
    full = read_checkpoint(interval)
    parts = {k.split(".")[0] for k in full}
    assert parts == {"model", "optimizer", "lr_scheduler", "train_state", "dataloader", "rng"}
    assert full["model.tok_embeddings.weight"].dtype == torch.float32

    # Loads as initial weights (model only, cast back to fp32) on one process.
    from tests.distributed.test_checkpoint_initial_load import _trainer_weights

    expected = {k.removeprefix("model."): v.float() for k, v in entries.items()}
    init_argv = [
        *ckpt_argv("--training.local_batch_size", "8", steps=STEPS),
        "--job.dump_folder",
        str(tmp_path / "fresh"),
        "--checkpoint.initial_load_path",
        str(export),
    ]
    bad = run_ranks(_trainer_weights, 1, init_argv, expected)[0]
    assert not bad, f"initial weights differ from the export: {bad[:5]}"

    # scripts/convert_to_hf.py accepts it.
    to_hf = load("scripts/convert_to_hf.py", "to_hf")
    assert to_hf.main([str(export), str(tmp_path / "hf"), "--dtype", "bfloat16"]) == 0
    from safetensors.torch import load_file

    hf = {}
    for f in (tmp_path / "hf").glob("*.safetensors"):
        hf.update(load_file(str(f)))
    assert torch.equal(hf["model.embed_tokens.weight"], entries["model.tok_embeddings.weight"]), (
        "HF embedding differs from the export"
    )
