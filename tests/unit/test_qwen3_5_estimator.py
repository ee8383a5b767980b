"""The memory estimate of Qwen3.5 (docs/qwen3_5.md, "Memory and FLOPs"): each block kind's
saved activations against ``saved_tensors_hooks``, the per-layer parameter shapes against the
built model, the DeltaNet state per head (not per token), and the whole estimate against the
measured peak of live tensor memory."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.launcher import run_ranks
from tests.saved_tensors import saved_bytes
from tests.unit import test_estimator as dense
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.qwen3_5 import QWEN35_FLAVORS, Qwen35Transformer
from torchtitan.planner.memory_terms import layer_activations, layer_shapes, stage_shapes

ONE = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, world_size=1)


@pytest.mark.parametrize("seq", [64, 256])
@pytest.mark.parametrize("layer", [0, 3], ids=["deltanet", "attention"])
def test_block_activations_match_saved_tensors(layer: int, seq: int) -> None:
    """Blocks 0 (DeltaNet) and 3 (gated attention), 2 x ``seq`` tokens, fp32 on CPU: the
    formula within 3% of what autograd saves (measured -0.1% to -1.2%)."""
    a = dataclasses.replace(QWEN35_FLAVORS["debugmodel"], max_seq_len=seq)
    model = Qwen35Transformer(a)
    model.init_weights(seed=0)
    x = torch.randn(2, seq, a.dim, requires_grad=True)
    got = saved_bytes(model, lambda: model.layers[str(layer)](x, model.freqs_cis[:seq]))
    formula = layer_activations(a, layer, 2 * seq, 4, ONE, "none", "cpu")
    print(
        f"block {layer}, seq {seq}: saved {got}, formula {formula} ({(formula - got) / got:+.2%})"
    )
    assert abs(formula - got) / got < 0.03


def test_deltanet_state_is_per_head_not_per_token() -> None:
    """Doubling the sequence doubles a DeltaNet block's per-token terms only: its state adds
    ``H x Dk x Dv`` per chunk (bytes per token constant), unlike attention's KV per token."""
    a = QWEN35_FLAVORS["27B"]
    per_token = [
        a.block_saved_bytes(0, tokens, 2, 1, "none") / tokens for tokens in (4096, 8192, 65536)
    ]
    assert per_token[0] == pytest.approx(per_token[2], rel=1e-9)
    assert a.delta_state_elems() == 48 * 128 * 128


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_moe"])
def test_layer_shapes_count_every_parameter(flavor: str) -> None:
    """The estimator's per-layer shapes hold exactly the built block's parameters (the MoE
    flavor: besides the router and routed experts, which the MoE terms add)."""
    a = QWEN35_FLAVORS[flavor]
    with torch.device("meta"):
        model = Qwen35Transformer(a)
    shapes = stage_shapes(a, 1)
    for layer in (0, 3):
        block, _ = layer_shapes(a, layer, 1, shapes)
        counted = sum(x * y for x, y in block)
        built = model.layers[str(layer)]
        if a.moe is not None:
            counted -= sum(x * y for x, y in block[-5:-2])  # the dense SwiGLU it does not have
            counted += a.moe.num_experts * a.dim * (1 + 3 * a.moe.expert_dim)
        assert counted == sum(p.numel() for p in built.parameters())


def test_estimate_within_10_percent_of_measured_peak(tmp_path: object) -> None:
    """One rank training the debug flavor: estimate vs the measured peak of live tensors."""
    argv = [*dense.BASE, "--model.name", "qwen3_5", "--job.dump_folder", str(tmp_path)]
    dense.assert_estimate_matches("qwen3_5 debug", argv, 1, run_ranks(dense._measure, 1, argv, 2))


@pytest.mark.parametrize("seq", [128, 256])
def test_flops_per_token_match_torch_flop_counter(seq: int) -> None:
    """MFU's count (``flops_per_token``) against torch's FLOP counter over one forward and
    backward of a DeltaNet-only model: the matmuls within 2% (the norms' weights count in
    ``N``), the delta rule's batched matmuls exactly (its triangular solves are not matmuls to
    the counter); bounded per token in ``seq``."""
    from torch.utils.flop_counter import FlopCounterMode

    from tests.tiny_args import tiny_qwen3_5

    a = tiny_qwen3_5(
        dim=128,
        layer_types=("linear_attention",) * 4,
        max_seq_len=seq,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
    )
    model = Qwen35Transformer(a)
    model.init_weights(seed=0)
    tokens = torch.randint(0, a.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model(tokens).float().sum().backward()
    counts = {str(k): v / seq for k, v in counter.get_flop_counts()["Global"].items()}
    dense = 6 * a.num_params(exclude_embedding=True, active=True)
    rule = a.flops_per_token(seq) - dense
    print(f"seq {seq}: matmuls {counts['aten.mm']:,.0f} vs 6N {dense:,.0f}; delta rule "
          f"{counts['aten.bmm']:,.0f} vs {rule:,.0f}")  # fmt: skip
    assert abs(counts["aten.mm"] - dense) / dense < 0.02
    assert abs(counts["aten.bmm"] - rule) / counts["aten.bmm"] < 1e-6
    assert a.flops_per_token(seq) < a.flops_per_token(1 << 20) < 1.1 * a.flops_per_token(seq)
