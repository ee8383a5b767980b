"""train_configs/qwen3_*.toml and gpt_oss_20b.toml validate at their published world sizes and
build through the full parallelize path on the fake backend (one process plays one rank; nothing
is materialized): every parameter is an FSDP-sharded DTensor and the rank holds its share of
the closed-form parameter count."""

from __future__ import annotations

import math

import pytest
from torch import nn
from torch.distributed.tensor import DTensor

from tests.unit.test_big_configs import _build_rank, _clean, _load, fake_rank  # noqa: F401
from torchtitan.models import MODELS, runtime_args

VOCAB = 128256  # what _build_rank gives the model


@pytest.mark.parametrize(
    ("name", "world", "rank"),
    [("qwen3_8b.toml", 8, 3), ("qwen3_30b_a3b.toml", 16, 11), ("gpt_oss_20b.toml", 8, 5)],
)
def test_qwen3_config_builds(fake_rank: None, name: str, world: int, rank: int) -> None:  # noqa: F811
    cfg = _load(name, world)
    dims, parts, _ = _build_rank(cfg, world, rank)
    fsdp = dims.dp_shard
    local, want = 0, 0
    for part in parts:
        for raw, p in part.named_parameters():
            assert isinstance(p, DTensor) and p.device.type == "meta", _clean(raw)
            assert (p.device_mesh.mesh_dim_names or ())[0] == "dp_shard_cp"
            local += p.to_local().numel()
            n0 = p.shape[0]  # FSDP2: dim 0 in chunks of ceil(n0 / fsdp)
            chunk = math.ceil(n0 / fsdp)
            rows = max(0, min(chunk, n0 - dims.coordinates()["dp_shard"] * chunk))
            want += rows * (p.numel() // n0)
    spec = MODELS[cfg.model.name]
    args = runtime_args(spec, cfg.model.flavor, VOCAB, cfg.training.seq_len)
    total = spec.num_params(args)
    print(f"{name} rank {rank}: {local:,} of {total:,} parameters")
    assert local == want
    assert abs(local - total / fsdp) / (total / fsdp) < 0.01


def test_ep2_fsdp2_layout() -> None:
    """4 ranks, ep 2: every expert weight [8, ...] is split 2 ways by ep and 2 by efsdp (FSDP2's
    EP layout on the (efsdp, ep) mesh); everything else is FSDP over all 4 ranks.

    Built in a forked child: process groups that an expert-parallel mesh registers on the fake
    backend, left in this (pytest) process, make later forked gloo ranks resolve collectives to
    stale group names (measured on torch 2.13)."""
    from tests.launcher import run_ranks

    assert run_ranks(_ep2_fsdp2_layout, 1) == [12]


def _ep2_fsdp2_layout() -> int:
    import torch.distributed as dist

    from tests.unit.test_big_configs import ROOT
    from torchtitan.config import parse_args
    from torchtitan.preflight.validate import validate_config

    argv = ["--job.config_file", str(ROOT / "train_configs" / "debug_model.toml")]
    argv += ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe"]
    argv += ["--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "2"]
    cfg = parse_args(argv)
    validate_config(cfg, world_size=4)
    _, parts, _ = _build_rank(cfg, 4, rank=3)
    experts = count_expert_dtensors(parts[0], ("efsdp", "ep"), ("dp_shard_cp",))
    dist.destroy_process_group()
    return experts  # w1 w2 w3 in 4 MoE blocks


def count_expert_dtensors(
    model: nn.Module, expert_mesh: tuple[str, ...], other_mesh: tuple[str, ...]
) -> int:
    """Every parameter of ``model`` (``debugmodel_moe`` under EP 2) is a DTensor: the routed
    experts' on ``expert_mesh``, each rank holding 2 of the 8, the rest on ``other_mesh``.
    Returns the number of expert weights."""
    experts = 0
    for raw, p in model.named_parameters():
        assert isinstance(p, DTensor)
        names = p.device_mesh.mesh_dim_names
        if ".experts.w" in raw:
            experts += 1
            assert names == expert_mesh, (raw, names)
            assert p.shape[0] == 8 and p.to_local().shape[0] == 2, (raw, p.to_local().shape)
        else:
            assert names == other_mesh, (raw, names)
    return experts


def test_explain_moe_lines() -> None:
    """--job.explain of the 30B-A3B config with EP 8 on 16 ranks: closed-form expert figures."""
    from tests.unit.test_big_configs import ROOT
    from torchtitan.config import parse_args
    from torchtitan.planner.explain import explain

    path = str(ROOT / "train_configs" / "qwen3_30b_a3b.toml")
    cfg = parse_args(["--job.config_file", path, "--parallelism.expert_parallel_degree", "8"])
    text = explain(cfg, 16, device_type="cuda")
    print(text)
    assert "48 MoE layers x 128 experts (top-8" in text
    assert "16 experts per layer (ep=8), sharded over efsdp=2" in text
    # 48 x 128 x 3 x 2048 x 768 / 16 = 1,811.9 M; x 16 bytes = 27.0 GiB
    assert "1,811.9 M expert parameters, 27.00 GiB" in text
    # 4096 tokens x top-8 x 2048 x 2 bytes (bf16) x 7/8 = 112 MiB one way, per layer
    assert "112.0 MiB sent per MoE layer" in text


def test_banner_names_the_family_and_flavor_built() -> None:
    """The debug config (description "Llama 3 debug model") run as Qwen3-30B-A3B: the
    preflight banner names what is built, the config's description only as the job's label."""
    from tests.unit.test_big_configs import ROOT
    from torchtitan.config import parse_args
    from torchtitan.planner.explain import explain

    path = str(ROOT / "train_configs" / "debug_model.toml")
    argv = ["--job.config_file", path, "--model.name", "qwen3", "--model.flavor", "30B-A3B"]
    argv += ["--lora.enable", "--lora.quantize_base", "nf4"]
    banner = explain(parse_args(argv), 8, device_type="cuda").splitlines()[0]
    assert banner.startswith("== preflight: qwen3 30B-A3B + LoRA rank 8 on an NF4 base ("), banner
    assert banner.endswith("; job 'Llama 3 debug model'"), banner
