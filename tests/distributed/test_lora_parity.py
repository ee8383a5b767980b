"""LoRA trains like one process (docs/lora.md; docs/architecture.md, promise 1): the debug
models with adapters on every attention and MLP projection (routed experts too for Qwen3-MoE)
give the single-process losses (fp32, relative 1e-5, 10 steps) under FSDP 2 (fast), TP 2, PP 2,
EP 2 and FSDP 2 with AC and compile (slow), and GPT-OSS with its family's default targets (the
biased attention projections) under FSDP 2; every rank's base weights are bitwise unchanged after training, the adapters
moved, and the adapter checkpoint holds only the adapters (its size is printed)."""

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

STEPS = 10
LORA = [
    "--lora.enable",
    "--lora.rank",
    "4",
    "--lora.target_modules",
    "attention.w*,feed_forward.w*,feed_forward.experts",
    "--optimizer.lr",
    "1e-2",
]
MOE = ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe"]
# No --lora.target_modules: the family's default (its attention projections, with biases).
GPT_OSS_LORA = ["--lora.enable", "--lora.rank", "4", "--optimizer.lr", "1e-2"]
GPT_OSS = ["--model.name", "gpt_oss", "--model.flavor", "debugmodel"]
# Its biased attention projections and its own experts (GptOssExperts: gate_up_proj, down_proj).
GPT_OSS_EXPERTS = [
    *GPT_OSS_LORA,
    "--lora.target_modules",
    "attention.w*,feed_forward.experts",
]


def _local(p: torch.Tensor) -> torch.Tensor:
    return (p.to_local() if isinstance(p, DTensor) else p).detach().clone()


def _lora_rank(argv: list[str], dump: str) -> tuple[list[dict] | None, bool, bool, list[str]]:
    from torchtitan.distributed.utils import destroy_distributed
    from torchtitan.lora.layers import is_adapter_name
    from torchtitan.preflight.validate import load_config
    from torchtitan.training.trainer import Trainer

    cfg = load_config(["--job.config_file", DEBUG_TOML, "--job.dump_folder", dump, *argv])
    trainer = Trainer(cfg)
    try:
        named = [(n, p) for part in trainer.model_parts for n, p in part.named_parameters()]
        before = {n: _local(p) for n, p in named}
        trainer.train()
    finally:
        trainer.close()
        destroy_distributed()
    base_same = all(torch.equal(_local(p), before[n]) for n, p in named if not is_adapter_name(n))
    moved = any(not torch.equal(_local(p), before[n]) for n, p in named if is_adapter_name(n))
    path = Path(dump) / "metrics" / f"rank_{os.environ['RANK']}.jsonl"
    trainable = sorted(n for n, p in named if p.requires_grad)
    return (read_jsonl(path) if path.exists() else None), base_same, moved, trainable


def lora_run(extra: list[str], world: int, dump: Path, lora: list[str] = LORA) -> list[dict]:
    argv = [*TINY, "--training.steps", str(STEPS), *lora, *extra]
    results = run_ranks(_lora_rank, world, argv, str(dump))
    for rank, (_, base_same, moved, trainable) in enumerate(results):
        assert base_same, f"rank {rank}: a base weight changed"
        assert moved, f"rank {rank}: no adapter changed"
        assert trainable and all(".lora_" in n for n in trainable), trainable
    assert results[0][0] is not None
    return results[0][0]


_REF: dict[str, list[dict]] = {}


def reference(family: str, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    if family not in _REF:
        extra = [*(MOE if family == "moe" else []), "--training.local_batch_size", "8"]
        _REF[family] = lora_run(extra, 1, tmp_path_factory.mktemp(f"lora_ref_{family}"))
    return _REF[family]


def test_lora_fsdp2_matches_one_process(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    ref = reference("llama3", tmp_path_factory)
    extra = [
        "--training.local_batch_size",
        "4",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "5",
    ]
    got = lora_run(extra, 2, tmp_path)
    assert_losses_match(losses(ref), losses(got), rtol=1e-5, label="LoRA FSDP 2")
    ckpt = tmp_path / "checkpoint" / f"step-{STEPS}"
    size = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
    from torchtitan.checkpoint.storage import read_model_weights

    model = read_model_weights(ckpt)
    assert model and all(".lora_" in k for k in model), sorted(model)[:3]
    n = sum(t.numel() for t in model.values())
    print(f"LoRA checkpoint step-{STEPS}: {size / 1024:.0f} KiB on disk, {n:,} adapter values")


LAYOUTS = {
    "TP 2": ("llama3", ["--parallelism.tensor_parallel_degree", "2"], "8"),
    "PP 2": ("llama3", ["--parallelism.pipeline_parallel_degree", "2"], "8"),
    "EP 2": ("moe", [*MOE, "--parallelism.expert_parallel_degree", "2"], "4"),
    "FSDP 2 + AC + compile": (
        "llama3",
        ["--activation_checkpoint.mode", "full", "--compile.enable"],
        "4",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_lora_layout_matches_one_process(
    layout: str, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    family, extra, local = LAYOUTS[layout]
    ref = reference(family, tmp_path_factory)
    got = lora_run([*extra, "--training.local_batch_size", local], 2, tmp_path)
    assert_losses_match(losses(ref), losses(got), rtol=1e-5, label=f"LoRA {layout}")


def test_lora_gpt_oss_fsdp2_matches_one_process(tmp_path: Path) -> None:
    one = lora_run(
        [*GPT_OSS, "--training.local_batch_size", "8"], 1, tmp_path / "one", GPT_OSS_LORA
    )
    two = lora_run(
        [*GPT_OSS, "--training.local_batch_size", "4"], 2, tmp_path / "two", GPT_OSS_LORA
    )
    assert_losses_match(losses(one), losses(two), rtol=1e-5, label="GPT-OSS LoRA FSDP 2")


GPT_OSS_LAYOUTS = {
    "EP 2": (["--parallelism.expert_parallel_degree", "2"], "4"),
    "TP 2": (["--parallelism.tensor_parallel_degree", "2"], "8"),
    "PP 2": (["--parallelism.pipeline_parallel_degree", "2"], "8"),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(GPT_OSS_LAYOUTS))
def test_lora_gpt_oss_experts_layout_matches_one_process(
    layout: str, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """GPT-OSS with adapters on its biased attention projections and its own experts: EP 2
    shards the expert adapter stacks with the experts, TP 2 splits the biased projections (the
    experts run replicated), PP 2 carries them with their stage."""
    if "gpt_oss_experts" not in _REF:
        dump = tmp_path_factory.mktemp("lora_ref_gpt_oss")
        argv = [*GPT_OSS, "--training.local_batch_size", "8"]
        _REF["gpt_oss_experts"] = lora_run(argv, 1, dump, GPT_OSS_EXPERTS)
    extra, local = GPT_OSS_LAYOUTS[layout]
    argv = [*GPT_OSS, *extra, "--training.local_batch_size", local]
    got = lora_run(argv, 2, tmp_path, GPT_OSS_EXPERTS)
    ref = _REF["gpt_oss_experts"]
    assert_losses_match(losses(ref), losses(got), rtol=1e-5, label=f"GPT-OSS expert LoRA {layout}")
