"""train_configs/deepseek_v3_*.toml validate at their world sizes and build through the full
parallelize path on the fake backend (one process plays one rank; nothing is materialized):
every parameter is a sharded DTensor on meta, the routed experts on the expert-parallel mesh
(``efsdp`` x ``ep``), everything else FSDP-sharded over all ranks; the MTP module of the 671B
flavor is there and checkpointed like a block's."""

from __future__ import annotations

import math

import pytest
from torch.distributed.tensor import DTensor

from tests.unit.test_big_configs import _build_rank, _clean, _load, fake_rank  # noqa: F401
from torchtitan.models import MODELS, runtime_args

VOCAB = 128256  # what _build_rank gives the model


@pytest.mark.slow  # about a minute each on a shared 2-core CPU
@pytest.mark.parametrize(
    ("name", "world", "rank"),
    [("deepseek_v3_16b.toml", 8, 5), ("deepseek_v3_671b.toml", 2048, 1029)],
)
def test_deepseek_v3_config_builds(fake_rank: None, name: str, world: int, rank: int) -> None:  # noqa: F811
    cfg = _load(name, world)
    dims, parts, _ = _build_rank(cfg, world, rank)
    ep = cfg.parallelism.expert_parallel_degree
    spec = MODELS["deepseek_v3"]
    args = runtime_args(spec, cfg.model.flavor, VOCAB, cfg.training.seq_len)
    local, want, names = 0, 0, []
    for part in parts:
        for raw, p in part.named_parameters():
            fqn = _clean(raw)
            names.append(fqn)
            assert isinstance(p, DTensor) and p.device.type == "meta", fqn
            mesh = p.device_mesh.mesh_dim_names or ()
            local += p.to_local().numel()
            if ".moe.experts." in fqn:
                assert mesh == (("efsdp", "ep") if world > ep else ("ep",)), (fqn, mesh)
                shards = [world // ep, ep]
            else:
                assert mesh[0] == "dp_shard_cp", (fqn, mesh)
                shards = [world]
            # Expected rows: EP splits the experts evenly, FSDP2 dim 0 in ceil-sized chunks.
            rows, coord = p.shape[0], dims.coordinates()
            if len(shards) == 2:
                rows //= ep
                n, idx = shards[0], rank // ep % shards[0]
            else:
                n, idx = world, coord["dp_shard"]
            chunk = math.ceil(rows / n)
            want += max(0, min(chunk, rows - idx * chunk)) * (p.numel() // p.shape[0])
    assert local == want
    total = spec.num_params(args)
    assert ("mtp.0.eh_proj.weight" in names) == (args.mtp_depth > 0)
    print(f"{name} rank {rank}: {local:,} of {total:,} parameters")
