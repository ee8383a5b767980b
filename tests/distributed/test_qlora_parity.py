"""QLoRA beyond one process (docs/lora.md, "QLoRA"): the NF4 base sharded by FSDP 2 holds, on
each rank, its row block of the very codes and scales one process computes (quantized whole,
then split), so FSDP 2 trains like one-process QLoRA: losses within 1e-5 relative over 10 steps
(fp32 compute, adapters on every attention and SwiGLU projection of the debug Llama 3), and so
does PP 2 (slow); the NF4 base is bitwise unchanged after training and the adapters moved."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

# Import the trainer in the parent so forked ranks start without re-importing it.
import torchtitan.training.trainer  # noqa: F401
from tests.launcher import run_ranks
from tests.parity import DEBUG_TOML, TINY, assert_losses_match, losses, read_jsonl

pytest.importorskip("torchao")

STEPS = 10
QLORA = [
    "--lora.enable",
    "--lora.rank",
    "4",
    "--lora.target_modules",
    "attention.w*,feed_forward.w*",
    "--lora.quantize_base",
    "nf4",
    "--optimizer.lr",
    "1e-2",
]


def _codes(p: torch.Tensor) -> list[torch.Tensor]:
    """A weight's stored values: an NF4 tensor's codes and scales, else the tensor."""
    local = (p.to_local() if isinstance(p, DTensor) else p).detach()
    if type(local).__name__ == "NF4Tensor":
        names = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean")
        return [getattr(local, n).clone() for n in names]
    return [local.clone()]


def _qlora_rank(argv: list[str], dump: str) -> tuple[list[dict] | None, bool, bool, int]:
    from torchtitan.distributed.utils import destroy_distributed
    from torchtitan.lora.layers import is_adapter_name
    from torchtitan.preflight.validate import load_config
    from torchtitan.training.trainer import Trainer

    cfg = load_config(["--job.config_file", DEBUG_TOML, "--job.dump_folder", dump, *argv])
    trainer = Trainer(cfg)
    try:
        named = [(n, p) for part in trainer.model_parts for n, p in part.named_parameters()]
        before = {n: _codes(p) for n, p in named}
        nf4 = sum(v[0].numel() for v in before.values() if len(v) > 1)  # local code bytes
        trainer.train()
    finally:
        trainer.close()
        destroy_distributed()
    same = all(
        all(torch.equal(a, b) for a, b in zip(_codes(p), before[n]))
        for n, p in named
        if not is_adapter_name(n)
    )
    moved = any(not torch.equal(_codes(p)[0], before[n][0]) for n, p in named if ".lora_" in n)
    path = Path(dump) / "metrics" / f"rank_{os.environ['RANK']}.jsonl"
    return (read_jsonl(path) if path.exists() else None), same, moved, nf4


def qlora_run(extra: list[str], world: int, dump: Path) -> tuple[list[dict], int]:
    argv = [*TINY, "--training.steps", str(STEPS), *QLORA, *extra]
    results = run_ranks(_qlora_rank, world, argv, str(dump))
    for rank, (_, same, moved, nf4) in enumerate(results):
        assert same, f"rank {rank}: a base weight changed"
        assert moved, f"rank {rank}: no adapter changed"
        assert nf4 > 0, f"rank {rank}: no NF4 weight"
    assert results[0][0] is not None
    return results[0][0], results[0][3]


_REF: list[tuple[list[dict], int]] = []


def _reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], int]:
    if not _REF:
        dump = tmp_path_factory.mktemp("qlora_ref")
        ref, codes = qlora_run(["--training.local_batch_size", "8"], 1, dump)
        assert ref[-1]["loss"] < ref[0]["loss"] - 0.3, losses(ref)
        _REF.append((ref, codes))
    return _REF[0]


def test_qlora_fsdp2_matches_one_process(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    ref, codes = _reference(tmp_path_factory)
    got, local_codes = qlora_run(["--training.local_batch_size", "4"], 2, tmp_path)
    assert_losses_match(losses(ref), losses(got), rtol=1e-5, label="QLoRA FSDP 2")
    print(f"QLoRA FSDP 2: {local_codes:,} of {codes:,} NF4 code bytes on rank 0")
    assert local_codes * 2 == codes  # the NF4 base is sharded, not replicated


@pytest.mark.slow
def test_qlora_pp2_matches_one_process(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    ref, _ = _reference(tmp_path_factory)
    extra = ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "8"]
    got, _ = qlora_run(extra, 2, tmp_path)
    assert_losses_match(losses(ref), losses(got), rtol=1e-5, label="QLoRA PP 2")
