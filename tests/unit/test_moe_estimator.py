"""Memory estimate of Mixture-of-Experts blocks (``planner/moe_memory.py``): the saved-activation
formula against ``saved_tensors_hooks``, the expert storage per rank under expert parallel, and
calibration against the measured peak of live tensor memory (``LiveTensorTracker``) for the
``debugmodel_moe`` flavor: one process, FSDP 2, EP 2, EP 2 x FSDP 2 (docs/planning.md, "MoE").
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.launcher import run_ranks
from tests.unit import test_estimator as dense
from torchtitan.config.manager import parse_args
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.qwen3.args import QWEN3_FLAVORS
from torchtitan.planner.estimator import estimate_memory, model_args_for
from torchtitan.planner.moe_memory import all_to_all_bytes, expert_layout

MOE = ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe"]


def _saved_bytes(flavor: str, tokens: int = 128) -> tuple[int, int]:
    """(bytes autograd saves for one block, the estimator's formula)."""
    from torchtitan.models.common.moe import grouped_mm_supported
    from torchtitan.models.qwen3.model import Transformer
    from torchtitan.planner.memory_terms import layer_activations as _layer_activations

    grouped_mm_supported("cpu", torch.float32)
    args = dataclasses.replace(QWEN3_FLAVORS[flavor], n_layers=1, max_seq_len=64)
    torch.manual_seed(0)
    got = dense.saved_block_bytes(Transformer(args), args.dim, tokens // 64)
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, world_size=1)
    return got, _layer_activations(args, 0, tokens, 4, dims, "none", "cpu")


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_moe"])
def test_block_activations_match_saved_tensors(flavor: str) -> None:
    """Qwen3 blocks (QK-norm; MoE: router, T k permuted rows, expert SwiGLU, shared experts)."""
    got, formula = _saved_bytes(flavor)
    print(f"{flavor}: saved {got} bytes, formula {formula}")
    assert abs(got - formula) / got < 0.01


def test_expert_storage_per_rank() -> None:
    """E / (ep x efsdp) experts per rank; total vs active parameters of the 30B flavor."""
    a = QWEN3_FLAVORS["30B-A3B"]
    lay = expert_layout(a.moe, ep=8, n_shard=64, fsdp=True)
    assert (lay.local_experts, lay.efsdp, lay.stored_experts, lay.gathered_experts) == (
        16,
        8,
        2,
        16,
    )
    assert expert_layout(a.moe, ep=8, n_shard=8, fsdp=True).gathered_experts == 0  # efsdp 1
    assert expert_layout(a.moe, ep=1, n_shard=256, fsdp=True).stored_experts == 1  # padded
    assert a.num_params() == pytest.approx(30.53e9, rel=1e-3)
    assert a.num_params(active=True) == pytest.approx(3.35e9, rel=1e-3)
    # 4096 tokens x top-8 x 2048 x 2 bytes x 7/8, one dispatch
    assert all_to_all_bytes(a, 4096, 2, 8) == 4096 * 8 * 2048 * 2 * 7 / 8
    cfg = parse_args([*dense.BASE, *MOE])
    one = estimate_memory(cfg, 1, device_type="cpu")
    n = model_args_for(cfg).num_params()  # type: ignore[attr-defined]
    assert one.parameters == 4 * n  # fp32 master weights, every expert
    ep = estimate_memory(
        parse_args([*dense.BASE, *MOE, "--parallelism.expert_parallel_degree", "2"]),
        4,
        device_type="cpu",
    )
    experts = 4 * 8 * 3 * 256 * 128  # layers x experts x (w1 w2 w3)
    assert ep.parameters == pytest.approx(4 * ((n - experts) / 4 + experts / 4), rel=0.01)


def _measure(argv: list[str], steps: int) -> int:
    from torchtitan.models.common.moe import grouped_mm_supported

    # The grouped-GEMM probe runs a small backward; run it before any checkpointed forward
    # (inside one, its saved tensors break the recompute's tensor count).
    grouped_mm_supported("cpu", torch.float32)
    return dense._measure(argv, steps)


SAC = ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option"]
PP_MB4 = ["--parallelism.pipeline_parallel_microbatches", "4"]
CASES = {
    "moe-1rank-ac-none": (1, []),
    "moe-1rank-ac-full": (1, ["--activation_checkpoint.mode", "full"]),
    "moe-1rank-ac-op": (1, [*SAC, "op"]),
    "moe-1rank-ac-sel2": (1, [*SAC, "2"]),
    "moe-ep2": (2, ["--parallelism.expert_parallel_degree", "2"]),
    "moe-fsdp2": (2, []),
    "moe-ep2xfsdp2": (4, ["--parallelism.expert_parallel_degree", "2"]),
    # MoE blocks under TP run whole on each rank (replicated weights, gathered sequence).
    "moe-tp2": (2, ["--parallelism.tensor_parallel_degree", "2"]),
    "moe-pp2": (2, ["--parallelism.pipeline_parallel_degree", "2", *PP_MB4]),
}
SLOW = {"moe-1rank-ac-sel2", "moe-fsdp2", "moe-ep2xfsdp2", "moe-tp2", "moe-pp2"}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in CASES]
)
def test_moe_estimate_within_10_percent_of_measured_peak(name: str, tmp_path: object) -> None:
    world_size, overrides = CASES[name]
    argv = [*dense.BASE, "--job.dump_folder", str(tmp_path), *MOE, *overrides]
    measured = run_ranks(_measure, world_size, argv, 2)
    dense.assert_estimate_matches(name, argv, world_size, measured)


def test_explain_counts_the_experts_of_a_pipeline_rank() -> None:
    """EP 2 x PP 2 on 4 ranks: a rank holds 2 of the 4 MoE layers, 4 experts each, kept whole."""
    from torchtitan.planner.explain import explain

    over = ["--parallelism.expert_parallel_degree", "2", "--parallelism.pipeline_parallel_degree"]
    cfg = parse_args([*dense.BASE, *MOE, *over, "2"])
    text = explain(cfg, 4, device_type="cpu")
    per_rank = 2 * 4 * 3 * 256 * 128  # layers x experts x w1 w2 w3
    assert "(pp rank with the most: 2 MoE layers): 4 experts per layer (ep=2)" in text
    assert f"{per_rank / 1e6:,.1f} M expert parameters" in text
    assert f"{per_rank * 16 / 2**20:.1f} MiB with gradients and optimizer states" in text


def test_explain_counts_the_experts_in_its_memory_table() -> None:
    """30B-A3B, EP 8 on 16 ranks: explain's expert lines and the estimate share one count."""
    from tests.unit.test_big_configs import ROOT
    from torchtitan.planner.explain import explain
    from torchtitan.planner.moe_memory import layer_expert_elems

    path = str(ROOT / "train_configs" / "qwen3_30b_a3b.toml")
    cfg = parse_args(["--job.config_file", path, "--parallelism.expert_parallel_degree", "8"])
    text = explain(cfg, 16, device_type="cuda")
    print(text)
    assert "dense" not in text
    a = model_args_for(cfg)
    stored, gathered = layer_expert_elems(a, 8, 16, True)
    assert (stored, gathered) == (8 * 3 * 2048 * 768, 16 * 3 * 2048 * 768)
    assert f"{48 * stored / 1e6:,.1f} M expert parameters, 27.00 GiB" in text
    assert "144.0 MiB gathered per MoE layer" in text  # 16 experts x 3 x 2048 x 768 x bf16
    est = estimate_memory(cfg, 16, device_type="cuda", model_args=a)
    # Every expert shard is in the estimate's parameters: 4 bytes x 48 x 8 experts.
    assert est.parameters > 4 * 48 * stored
