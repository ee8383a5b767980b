"""GRPO on FSDP 2 (docs/posttrain.md, "Generation"): the debug model as the Trainer shards
it samples its completions on gathered weights (each rank its own prompts), takes KL-regularised
steps with the frozen-shard reference, and every rank reports the same all-reduced metrics; the
policy moves and the reference's KL becomes positive after the first step."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

import torchtitan.training.trainer  # noqa: F401 - imported in the parent before the ranks fork
from scripts.make_posttrain_data import write
from tests.launcher import run_ranks
from tests.parity import DEBUG_TOML, TINY


def _grpo_rank(dump: str, data: str) -> list[dict]:
    import torch

    from torchtitan.distributed.utils import destroy_distributed
    from torchtitan.posttrain.grpo import GrpoSettings, GrpoStep, read_prompts
    from torchtitan.posttrain.reference import Reference
    from torchtitan.posttrain.rewards import resolve
    from torchtitan.preflight.validate import load_config
    from torchtitan.training.trainer import Trainer

    argv = ["--job.config_file", DEBUG_TOML, "--job.dump_folder", dump, *TINY]
    argv += ["--training.local_batch_size", "4", "--parallelism.data_parallel_shard_degree", "2"]
    trainer = Trainer(load_config(argv))
    try:
        dp = trainer.parallel_dims.get_mesh("dp")
        rank = dp.get_local_rank()
        prompts = read_prompts(data, trainer.tokenizer, 64, 4)[rank::2]
        parts = trainer.model_parts
        step = GrpoStep(
            parts, trainer.optimizer, trainer.lr_scheduler, GrpoSettings(k=2, max_new_tokens=4, beta=0.1),
            [resolve("format"), lambda c, a: float(len(c) % 3)], [1.0, 1.0], trainer.tokenizer,
            Reference(parts), dp, trainer.device, torch.Generator().manual_seed(rank),
        )  # fmt: skip
        return [step.run(prompts[2 * i : 2 * i + 2]) for i in range(2)]
    finally:
        trainer.close()
        destroy_distributed()


def test_grpo_runs_on_fsdp2_with_gathered_weights(tmp_path: Path) -> None:
    write(tmp_path, 8, 0, 9)
    results = run_ranks(_grpo_rank, 2, str(tmp_path / "dump"), str(tmp_path / "prompts.jsonl"))
    assert results[0] == results[1]  # every metric is reduced over the data-parallel ranks
    first, second = results[0]
    assert all(math.isfinite(v) for v in [*first.values(), *second.values()])
    assert first["kl"] == pytest.approx(0.0, abs=1e-6) and first["grad_norm"] > 0
    assert second["kl"] > 0  # the policy left the reference
