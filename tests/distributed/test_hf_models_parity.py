"""The ``hf`` family (docs/hf_models.md) through the real trainer on gloo ranks.

Eight tiny transformers architectures we do not implement natively (``tests/hf_models.py``):
each trains; FSDP 2 and FSDP 2 x TP 2 (TP from transformers' own plan, where it has one we
apply) match one process to 1e-5 over 10 steps; 3 + resumed 3 steps equal 6 straight ones
bitwise; a trained checkpoint exported with ``torchtitan.convert`` loads in transformers with
our logits. The fast tier runs Mistral's FSDP 2 case; the rest is ``slow``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.checkpoint_helpers import assert_bitwise_resume, ckpt_argv, train_with_faults
from tests.distributed.parity_cases import LOSS_RTOL, assert_grad_norms_match
from tests.hf_models import ARCHS, TP_PLANS, save_config
from tests.launcher import run_ranks
from tests.parity import assert_losses_match, losses, train_metrics

STEPS = 10
FSDP2 = ["--training.local_batch_size", "4"]
FSDP2_TP2 = [*FSDP2, "--parallelism.data_parallel_shard_degree", "2"]
FSDP2_TP2 += ["--parallelism.tensor_parallel_degree", "2"]


def _model(tmp: Path, arch: str) -> list[str]:
    folder = save_config(arch, tmp / f"hf_{arch}")
    return ["--model.name", "hf", "--model.flavor", str(folder), "--optimizer.lr", "3e-3"]


def _slow_unless(fast: bool, value: object) -> object:
    return value if fast else pytest.param(value, marks=pytest.mark.slow)


HSDP = [*FSDP2[:1], "2", "--parallelism.data_parallel_replicate_degree", "2"]
HSDP += ["--parallelism.data_parallel_shard_degree", "2"]
"""HSDP: 2 replicas x FSDP 2, 2 sequences per rank."""

CASES = [
    _slow_unless(arch == "mistral" and name == "fsdp2", (arch, name))
    for arch in ARCHS
    for name in ("fsdp2", "fsdp2_tp2")
    if name == "fsdp2" or arch in TP_PLANS
] + [pytest.param(("mistral", "hsdp"), marks=pytest.mark.slow)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_hf_model_matches_one_process(case: tuple[str, str], tmp_path: Path) -> None:
    arch, layout = case
    model = _model(tmp_path, arch)
    ref = train_metrics([*model, "--training.local_batch_size", "8"], 1, tmp_path / "one", STEPS)
    first, last = ref[0]["loss"], ref[-1]["loss"]
    assert last < first - 0.3, f"{arch} did not learn: {first:.3f} -> {last:.3f}"
    extra, world = {"fsdp2": (FSDP2, 2), "fsdp2_tp2": (FSDP2_TP2, 4), "hsdp": (HSDP, 4)}[layout]
    got = train_metrics([*model, *extra], world, tmp_path / layout, STEPS)
    label = f"hf {arch} {layout}"
    assert_losses_match(losses(ref), losses(got), rtol=LOSS_RTOL, label=label)
    assert_grad_norms_match(ref, got, label)


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(ARCHS))
def test_hf_model_resume_is_bitwise(arch: str, tmp_path: Path) -> None:
    assert assert_bitwise_resume(tmp_path, 2, *_model(tmp_path, arch), *FSDP2) > 0


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["mistral", "olmoe"])
def test_trained_checkpoint_exports_to_transformers(arch: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from torchtitan.checkpoint import hf_io
    from torchtitan.convert import to_hf
    from torchtitan.models import MODELS, runtime_args

    model = _model(tmp_path, arch)
    run_ranks(train_with_faults, 2, ckpt_argv(*model, *FSDP2), str(tmp_path / "run"))
    spec, flavor = MODELS["hf"], model[3]
    args = runtime_args(spec, flavor, 2048, 64)
    out = tmp_path / "export"
    to_hf(tmp_path / "run" / "checkpoint" / "step-6", out, "hf", args, None)  # verifies bitwise
    with torch.device("meta"):
        ours = spec.build(args)
    ours.to_empty(device="cpu")
    ours.init_weights(0)
    hf_io.load_hf_streaming([ours], spec.state_dict_adapter(args), out)
    theirs = AutoModelForCausalLM.from_pretrained(out, attn_implementation="sdpa").eval()
    tokens = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (theirs(input_ids=tokens).logits - ours.eval()(tokens)).abs().max().item()
    assert diff == 0.0, f"{arch}: transformers' logits {diff} apart from ours"


@pytest.mark.slow
def test_hf_model_compiled_and_checkpointed_per_layer_matches_eager(tmp_path: Path) -> None:
    """Activation checkpointing and torch.compile wrap each decoder layer (the blocks the plan
    finds); the losses stay those of the eager run."""
    model = [*_model(tmp_path, "gemma3"), "--training.local_batch_size", "8"]
    ref = train_metrics(model, 1, tmp_path / "eager", 4)
    extra = ["--activation_checkpoint.mode", "full", "--compile.enable"]
    got = train_metrics([*model, *extra], 1, tmp_path / "compiled", 4)
    assert_losses_match(losses(ref), losses(got), rtol=LOSS_RTOL, label="hf gemma3 ac+compile")
