"""train_configs/qwen3_*.toml validate at their published world sizes and build through the full
parallelize path on the fake backend (one process plays one rank; nothing is materialized):
every parameter is an FSDP-sharded DTensor and the rank holds its share of the closed-form
parameter count."""

from __future__ import annotations

import math

import pytest
from torch.distributed.tensor import DTensor

from tests.unit.test_big_configs import _build_rank, _clean, _load, fake_rank  # noqa: F401
from torchtitan.models import MODELS, runtime_args

VOCAB = 128256  # what _build_rank gives the model


@pytest.mark.parametrize(
    ("name", "world", "rank"), [("qwen3_8b.toml", 8, 3), ("qwen3_30b_a3b.toml", 16, 11)]
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
    args = runtime_args(MODELS["qwen3"], cfg.model.flavor, VOCAB, cfg.training.seq_len)
    total = MODELS["qwen3"].num_params(args)
    print(f"{name} rank {rank}: {local:,} of {total:,} parameters")
    assert local == want
    assert abs(local - total / fsdp) / (total / fsdp) < 0.01
