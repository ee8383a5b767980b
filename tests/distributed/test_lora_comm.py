"""What FSDP 2 reduce-scatters per step under LoRA vs full fine-tuning (docs/lora.md, "FSDP
traffic"): on the debug Llama 3 model (2 ranks, fp32 gradients) every call of
``torch.distributed.reduce_scatter_single`` (FSDP 2's reduce-scatter) is counted by its input
size; the bytes per step equal the parameters with ``requires_grad`` (dim 0 padded to a multiple
of the world size, 4 bytes each), i.e. only the adapters under LoRA. The figures are printed."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

# Import the trainer in the parent so forked ranks start without re-importing it.
import torchtitan.training.trainer  # noqa: F401
from tests.launcher import run_ranks
from tests.parity import DEBUG_TOML, TINY

STEPS = 2
ALL = ["--lora.target_modules", "attention.w*,feed_forward.w*"]
RUNS = {
    "full fine-tuning": [],
    "LoRA r=8 attention (default targets)": ["--lora.enable", "--lora.rank", "8"],
    "LoRA r=8 attention + MLP": ["--lora.enable", "--lora.rank", "8", *ALL],
}


def _count_rank(argv: list[str], dump: str) -> tuple[int, int, int]:
    """(bytes reduce-scattered per step, bytes of the trainable parameters as FSDP pads them,
    unpadded trainable bytes) on this rank."""
    import torch.distributed as dist

    from torchtitan.distributed.utils import destroy_distributed
    from torchtitan.preflight.validate import load_config
    from torchtitan.training.trainer import Trainer

    sent = [0]
    inner = dist.reduce_scatter_single

    def counting(output, input, *args, **kwargs):  # noqa: A002 (torch's keyword names)
        sent[0] += input.numel() * input.element_size()
        return inner(output, input, *args, **kwargs)

    dist.reduce_scatter_single = counting  # type: ignore[assignment]
    cfg = load_config(["--job.config_file", DEBUG_TOML, "--job.dump_folder", dump, *argv])
    trainer = Trainer(cfg)
    try:
        world = dist.get_world_size()
        trained = [p for part in trainer.model_parts for p in part.parameters() if p.requires_grad]
        padded = sum(_padded(p.shape, world) * 4 for p in trained)
        plain = sum(p.numel() * 4 for p in trained)
        trainer.train()
    finally:
        dist.reduce_scatter_single = inner  # type: ignore[assignment]
        trainer.close()
        destroy_distributed()
    return sent[0] // STEPS, padded, plain


def _padded(shape: tuple[int, ...], world: int) -> int:
    return math.ceil(shape[0] / world) * world * math.prod(shape[1:])


@pytest.mark.slow
def test_reduce_scatter_bytes_are_the_trainable_parameters(tmp_path: Path) -> None:
    got: dict[str, int] = {}
    for i, (label, extra) in enumerate(RUNS.items()):
        argv = [*TINY, "--training.steps", str(STEPS), "--training.local_batch_size", "4", *extra]
        (per_step, padded, plain), _ = run_ranks(_count_rank, 2, argv, str(tmp_path / str(i)))
        print(f"{label}: {per_step:,} bytes reduce-scattered per step ({plain:,} trainable)")
        assert per_step == padded, (label, per_step, padded)
        got[label] = per_step
    full = got["full fine-tuning"]
    for label, n in got.items():
        print(f"{label}: {n / full:.2%} of full fine-tuning")
    assert all(n < full / 10 for label, n in got.items() if label != "full fine-tuning")
