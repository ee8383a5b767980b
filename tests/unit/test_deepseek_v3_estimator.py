"""The memory estimate of DeepSeek-V3 (docs/planning.md, "MLA and MTP"): what MLA saves for
backward and the MTP modules' saved tensors, against ``saved_tensors_hooks`` on the debug
flavor; the whole estimate against the measured peak of live tensor memory; explain's MLA
and MTP lines."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.launcher import run_ranks
from tests.saved_tensors import saved_bytes
from tests.unit import test_estimator as dense
from torchtitan.config.manager import parse_args
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.deepseek_v3.args import DEEPSEEK_V3_FLAVORS, DeepSeekV3Args
from torchtitan.models.deepseek_v3.model import Transformer
from torchtitan.planner.memory_terms import layer_activations, mtp_saved_bytes, stage_shapes

DS = ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel"]
ONE = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, world_size=1)


def _args(**changes: object) -> DeepSeekV3Args:
    a = DEEPSEEK_V3_FLAVORS["debugmodel"]
    return dataclasses.replace(a, max_seq_len=64, vocab_size=512, **changes)  # type: ignore[arg-type]


@pytest.mark.parametrize("layer", [0, 1])
def test_mla_block_activations_match_saved_tensors(layer: int) -> None:
    """Block 0 (MLA + dense SwiGLU) and block 1 (MLA + MoE), 2 x 64 tokens, fp32 on CPU."""
    from torchtitan.models.common.moe import grouped_mm_supported

    grouped_mm_supported("cpu", torch.float32)
    a = _args()
    torch.manual_seed(0)
    model = Transformer(a)
    x = torch.randn(2, 64, a.dim, requires_grad=True)
    got = saved_bytes(model, lambda: model.layers[str(layer)](x, model.freqs_cis[:64]))
    formula = layer_activations(a, layer, 128, 4, ONE, "none", "cpu")
    print(f"block {layer}: saved {got} bytes, formula {formula} ({(formula - got) / got:+.3%})")
    assert abs(formula - got) / got < 0.01


@pytest.mark.parametrize("depth", [1, 2])
def test_mtp_activations_match_saved_tensors(depth: int) -> None:
    """A training forward with ``depth`` MTP modules saves, beyond the same model without
    MTP, their blocks (``layer_activations`` of blocks ``n_layers + k``) plus
    ``mtp_saved_bytes``."""
    from torchtitan.models.common.moe import grouped_mm_supported

    grouped_mm_supported("cpu", torch.float32)
    tokens = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    sizes = []
    for d in (depth, 0):
        model = Transformer(_args(mtp_depth=d))
        model.init_weights(seed=0)
        sizes.append(saved_bytes(model, lambda m=model: m(tokens, **m.batch_inputs(tokens))))
    got = sizes[0] - sizes[1]
    a = _args(mtp_depth=depth)
    blocks = sum(
        layer_activations(a, a.n_layers + k, 128, 4, ONE, "none", "cpu") for k in range(depth)
    )
    formula = blocks + mtp_saved_bytes(a, 128, 4, 1, depth)
    print(f"MTP depth {depth}: saved {got} bytes, formula {formula} ({(formula - got) / got:+.3%})")
    assert abs(formula - got) / got < 0.01


def test_mla_parameters_match_the_model() -> None:
    """The estimator's block shapes hold exactly the model's block parameters (MLA's five
    matmuls and two latent norms, SwiGLU, norms)."""
    for name in ("debugmodel", "16B", "671B"):
        a = DEEPSEEK_V3_FLAVORS[name]
        elems = sum(x * y for x, y in stage_shapes(a, 1).block)
        assert elems == a._layer_params(0, active=False), name


def test_explain_shows_mla_and_mtp() -> None:
    from torchtitan.planner.explain import explain

    cfg = parse_args([*dense.BASE, *DS, "--parallelism.pipeline_parallel_degree", "2"])
    text = explain(cfg, 2, device_type="cpu")
    assert "MTP: 1 module(s) on the last stage" in text
    assert "KV cache 640 bytes per token in bf16" in text  # (64 + 16) x 2 bytes x 4 layers


CASES = {
    "deepseek-1rank": (1, []),
    "deepseek-pp2": (2, ["--parallelism.pipeline_parallel_degree", "2"]),
}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n != "deepseek-1rank" else n for n in CASES]
)
def test_deepseek_estimate_within_10_percent_of_measured_peak(name: str, tmp_path: object) -> None:
    from torchtitan.models.common.moe import grouped_mm_supported

    grouped_mm_supported("cpu", torch.float32)
    world_size, overrides = CASES[name]
    argv = [*dense.BASE, "--job.dump_folder", str(tmp_path), *DS, *overrides]
    dense.assert_estimate_matches(
        name, argv, world_size, run_ranks(dense._measure, world_size, argv, 2)
    )
