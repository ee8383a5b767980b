"""train_configs/gpt_oss_20b.toml validates at its published world size (8) and builds through
the full parallelize path on the fake backend (one process plays one rank; nothing is
materialized): every parameter is an FSDP-sharded DTensor and the rank holds its share of the
closed-form parameter count. Context parallel is refused in preflight (sinks and windows have
no CP core)."""

from __future__ import annotations

import math

import pytest
from torch.distributed.tensor import DTensor

from tests.unit.test_big_configs import _build_rank, _clean, _load, fake_rank  # noqa: F401
from torchtitan.config import ConfigError, parse_args
from torchtitan.models import MODELS, runtime_args
from torchtitan.preflight.validate import validate_config

VOCAB = 128256  # what _build_rank gives the model


def test_gpt_oss_20b_config_builds(fake_rank: None) -> None:  # noqa: F811
    world, rank = 8, 5
    cfg = _load("gpt_oss_20b.toml", world)
    dims, parts, _ = _build_rank(cfg, world, rank)
    local, want = 0, 0
    for part in parts:
        for raw, p in part.named_parameters():
            assert isinstance(p, DTensor) and p.device.type == "meta", _clean(raw)
            local += p.to_local().numel()
            n0 = p.shape[0]  # FSDP2: dim 0 in chunks of ceil(n0 / fsdp)
            chunk = math.ceil(n0 / dims.dp_shard)
            rows = max(0, min(chunk, n0 - dims.coordinates()["dp_shard"] * chunk))
            want += rows * (p.numel() // n0)
    args = runtime_args(MODELS["gpt_oss"], cfg.model.flavor, VOCAB, cfg.training.seq_len)
    total = MODELS["gpt_oss"].num_params(args)
    print(f"gpt_oss_20b.toml rank {rank}: {local:,} of {total:,} parameters")
    assert local == want
    assert abs(local - total / dims.dp_shard) / (total / dims.dp_shard) < 0.01


def test_context_parallel_is_refused() -> None:
    argv = ["--model.name", "gpt_oss", "--model.flavor", "debugmodel"]
    cfg = parse_args([*argv, "--parallelism.context_parallel_degree", "2"])
    with pytest.raises(ConfigError, match="does not support context parallel"):
        validate_config(cfg, world_size=2)
