"""The MoE layer with the speed features (docs/moe.md, "Parallelisms"), no process group:

* float8 converts the dense linears of an MoE model and leaves every MoE layer (router, routed
  and shared experts) in high precision;
* compile: a compiled MoE layer equals eager (outputs, gradients, statistics), and its block is
  compiled with ``fullgraph=False`` (the routed experts may run eagerly);
* activation checkpointing recomputes the layer without counting its expert load twice.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from torchtitan.distributed.activation_checkpoint import _wrap_block
from torchtitan.distributed.compile import _may_break_graph
from torchtitan.distributed.float8 import apply_float8, float8_unsupported_reason
from torchtitan.models.common.moe import MoE, MoEArgs
from torchtitan.models.qwen3 import QWEN3_FLAVORS, Transformer

ARGS = MoEArgs(num_experts=8, top_k=2, expert_dim=32, num_shared_experts=1, aux_loss_coef=0.01)


def _layer() -> MoE:
    torch.manual_seed(0)
    layer = MoE(64, ARGS)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.1)
    return layer


def _step(layer: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    layer.zero_grad()
    out = layer(x)
    out.square().mean().backward()
    return out.detach(), [p.grad.clone() for p in layer.parameters()]


@pytest.mark.skipif(float8_unsupported_reason("cpu") is not None, reason="torchao unusable")
def test_float8_converts_dense_linears_only() -> None:
    # Blocks 1 and 3 MoE, 0 and 2 dense: the dense blocks' feed-forward is converted too.
    args = dataclasses.replace(QWEN3_FLAVORS["debugmodel_moe"], moe_layers=(1, 3))
    with torch.device("meta"):
        model = Transformer(args)
    converted = apply_float8(model, auto_filter_small_kn=False, device_type="cpu")
    attention = [f"layers.{i}.attention.{w}" for i in range(4) for w in ("wq", "wk", "wv", "wo")]
    dense_ffn = [f"layers.{i}.feed_forward.{w}" for i in (0, 2) for w in ("w1", "w2", "w3")]
    assert sorted(converted) == sorted(attention + dense_ffn)
    moe = model.layers["1"].feed_forward
    assert isinstance(moe, MoE)
    assert [type(m).__name__ for m in (moe.router.gate, moe.shared.w1)] == ["Linear", "Linear"]
    # ... and it trains: gradients reach a float8 linear and the high-precision experts.
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    model(torch.randint(0, args.vocab_size, (2, 16))).float().mean().backward()
    assert model.layers["0"].attention.wq.weight.grad is not None
    assert moe.experts.w1.grad is not None and moe.experts.w1.grad.abs().sum() > 0


def test_compiled_layer_equals_eager() -> None:
    layer = _layer()
    x = torch.randn(2, 16, 64)
    ref, ref_grads = _step(layer, x)
    stats = layer.tokens_per_expert.clone()
    layer.forward = torch.compile(layer.forward, backend="aot_eager")  # type: ignore[method-assign]
    out, grads = _step(layer, x)
    assert torch.allclose(out, ref, rtol=0, atol=1e-6)
    assert all(torch.allclose(g, r, rtol=0, atol=1e-7) for g, r in zip(grads, ref_grads))
    assert torch.equal(layer.tokens_per_expert, 2 * stats)  # counted once per forward
    assert _may_break_graph(torch.nn.Sequential(layer)) and not _may_break_graph(layer.router)


@pytest.mark.parametrize(("op_level", "compiled"), [(False, False), (True, False), (True, True)])
def test_checkpointed_layer_counts_its_load_once(op_level: bool, compiled: bool) -> None:
    layer = _layer()
    x = torch.randn(2, 16, 64)
    ref, ref_grads = _step(layer, x)
    load, aux = layer.load_since_log.clone(), layer.aux_since_log.clone()
    wrapped = _wrap_block(layer, op_level=op_level)
    if compiled:  # AC then compile, as parallelize applies them
        wrapped.forward = torch.compile(wrapped.forward, backend="aot_eager")  # type: ignore[method-assign]
    out, grads = _step(wrapped, x)
    assert torch.allclose(out, ref, rtol=0, atol=1e-6)
    assert all(torch.allclose(g, r, rtol=0, atol=1e-7) for g, r in zip(grads, ref_grads))
    assert torch.equal(layer.load_since_log, 2 * load)
    assert torch.equal(layer.aux_since_log, 2 * aux)


def test_grouped_mm_probe_inside_a_checkpointed_forward() -> None:
    """The first forward of a run may be a checkpointed one: the grouped-GEMM probe (forward
    and backward of its own) must not go through the checkpoint's saved-tensor hooks."""
    from torchtitan.models.common import moe_experts

    moe_experts._probe_grouped_mm.cache_clear()
    layer = _layer()
    x = torch.randn(2, 16, 64)
    out, grads = _step(_wrap_block(layer, op_level=False), x)
    ref, ref_grads = _step(layer, x)
    assert torch.equal(out, ref) and all(torch.equal(g, r) for g, r in zip(grads, ref_grads))


def test_hsdp_cp_ep_layout() -> None:
    """8 ranks on the fake backend, dp_replicate 2 x dp_shard 2 x cp 2, ep 2: ep is the cp axis
    (ranks 2r, 2r+1), the experts are FSDP-sharded over dp_shard (efsdp 2) and replicated across
    dp_replicate; every other weight is HSDP over (dp_replicate, dp_shard_cp). Built in a forked
    child (see tests/unit/test_qwen3_configs.py: test_ep2_fsdp2_layout)."""
    from tests.launcher import run_ranks

    assert run_ranks(_hsdp_cp_ep_layout, 1) == [([4, 5], [5, 7], 12)]


def _hsdp_cp_ep_layout() -> tuple[list[int], list[int], int]:
    import torch.distributed as dist

    from tests.unit.test_big_configs import ROOT, _build_rank
    from tests.unit.test_qwen3_configs import count_expert_dtensors
    from torchtitan.config import parse_args
    from torchtitan.preflight.validate import validate_config

    argv = ["--job.config_file", str(ROOT / "train_configs" / "debug_model.toml")]
    argv += ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe"]
    argv += ["--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "2"]
    argv += ["--parallelism.data_parallel_replicate_degree", "2"]
    argv += ["--parallelism.context_parallel_degree", "2"]
    cfg = parse_args(argv)
    validate_config(cfg, world_size=8)
    dims, parts, _ = _build_rank(cfg, 8, rank=5)
    assert dims.efsdp == 2
    experts = count_expert_dtensors(
        parts[0], ("ep_replicate", "efsdp", "ep"), ("dp_replicate", "dp_shard_cp")
    )
    groups = [dims.get_mesh(n).mesh.flatten().tolist() for n in ("ep", "efsdp")]
    dist.destroy_process_group()
    return groups[0], groups[1], experts
