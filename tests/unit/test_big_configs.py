"""The seed's big-model configs (8B on 8, 70B on 256, 405B on 512 ranks) through the real plan.

One process plays one rank with torch's ``fake`` backend (collectives are no-ops), the model is
built on the meta device, and the trainer's path runs unchanged: parse and validate the TOML at
its world size -> ParallelDims and the world mesh -> (405B) the pipeline split of this rank's
stages -> the float8 conversion where the config asks (405B; emulated, as on any machine
without float8 hardware) -> ``parallelize`` with the Llama 3 plan (TP with sequence/loss
parallel, activation checkpointing, per-block compile where the config asks, FSDP2). Nothing is
materialized.

The checks are against arithmetic written out here, not against the code's own view: every
parameter's local shard shape (TP splits the output dimension of column-parallel weights and
the input dimension of row-parallel ones; FSDP then splits dim 0 of that into ``dp_shard``
chunks) and this rank's parameter count. The vocabulary is the Llama 3 tokenizer's 128,256
(what the configs train with once ``model.tokenizer_path`` points at it).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from torchtitan.config import JobConfig, parse_args
from torchtitan.config.__main__ import main as config_cli
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.parallelize import parallelize
from torchtitan.distributed.pipeline_parallel import split_model
from torchtitan.models import MODELS, runtime_args
from torchtitan.preflight.validate import pipeline_stages, validate_config
from torchtitan.training.builders import build_meta_model

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 128256  # the Llama 3 tokenizer

# Shard dimension of each block weight under tensor parallel (0: column-parallel, the output
# features; 1: row-parallel, the input features); None: replicated (the RMSNorms).
_BLOCK_TP_DIM: dict[str, int | None] = {
    "attention.wq.weight": 0,
    "attention.wk.weight": 0,
    "attention.wv.weight": 0,
    "attention.wo.weight": 1,
    "feed_forward.w1.weight": 0,
    "feed_forward.w3.weight": 0,
    "feed_forward.w2.weight": 1,
    "attention_norm.weight": None,
    "ffn_norm.weight": None,
}
# Embedding: row-parallel over the vocabulary; output: column-parallel over the vocabulary.
_TOP_TP_DIM: dict[str, int | None] = {
    "tok_embeddings.weight": 0,
    "output.weight": 0,
    "norm.weight": None,
}


@pytest.fixture
def fake_rank() -> Iterator[None]:
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _load(name: str, world: int) -> JobConfig:
    """The config as ``python -m torchtitan.config --job.config_file F --world_size N`` checks
    it (its exit status must be 0), then parsed for the build."""
    path = str(ROOT / "train_configs" / name)
    argv = ["--job.config_file", path, "--world_size", str(world), "--job.fit_check", "off"]
    assert config_cli(argv) == 0  # a cluster's config, checked on this machine: no fit check
    cfg = parse_args(["--job.config_file", path])
    validate_config(cfg, world_size=world)
    return cfg


def _clean(name: str) -> str:
    for seg in ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module."):
        name = name.replace(seg, "")
    return name


def _expected_local(
    global_shape: tuple[int, ...], tp_dim: int | None, tp: int, fsdp: int, fsdp_rank: int
) -> tuple[int, ...]:
    """TP splits ``tp_dim`` evenly (the configs' sizes divide); FSDP2 then splits dim 0 of the
    TP shard into ``fsdp`` chunks of ``ceil(n / fsdp)`` rows (the last ones may be shorter)."""
    shape = list(global_shape)
    if tp_dim is not None:
        assert shape[tp_dim] % tp == 0
        shape[tp_dim] //= tp
    chunk = math.ceil(shape[0] / fsdp)
    shape[0] = max(0, min(chunk, shape[0] - fsdp_rank * chunk))
    return tuple(shape)


def _global_shape(
    fqn: str, dim: int, hidden: int, n_heads: int, kv_heads: int, head_dim: int
) -> tuple[int, ...]:
    if fqn in ("tok_embeddings.weight", "output.weight"):
        return (VOCAB, dim)
    if fqn == "norm.weight":
        return (dim,)
    suffix = fqn.split(".", 2)[2]
    return {
        "attention.wq.weight": (n_heads * head_dim, dim),
        "attention.wk.weight": (kv_heads * head_dim, dim),
        "attention.wv.weight": (kv_heads * head_dim, dim),
        "attention.wo.weight": (dim, n_heads * head_dim),
        "feed_forward.w1.weight": (hidden, dim),
        "feed_forward.w3.weight": (hidden, dim),
        "feed_forward.w2.weight": (dim, hidden),
        "attention_norm.weight": (dim,),
        "ffn_norm.weight": (dim,),
    }[suffix]


def _build_rank(
    cfg: JobConfig, world: int, rank: int
) -> tuple[ParallelDims, list[nn.Module], list[int]]:
    """This rank's parallelized model parts, as the trainer builds them (on meta)."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    dims = ParallelDims.from_config(cfg.parallelism, world)
    dims.build_mesh("cpu")
    spec = MODELS[cfg.model.name]
    args = runtime_args(spec, cfg.model.flavor, VOCAB, cfg.training.seq_len)
    # The trainer's converter step; float8 is emulated here (no float8 hardware).
    cfg.quantize.dense.float8.emulate = True
    model = build_meta_model(cfg, spec, args, dims, torch.device("cpu"))
    plan = pipeline_stages(cfg)
    stage_ids = plan.stage_ids(dims.coordinates()["pp"]) if plan else []
    model_plan = spec.parallel_plan(args)
    units = model_plan.pipeline_units
    parts = [split_model(model, units, plan.stage_units[s]) for s in stage_ids] if plan else [model]
    parts = [parallelize(p, model_plan, dims, cfg, torch.bfloat16, torch.float32) for p in parts]
    return dims, parts, stage_ids


def _check_rank(
    cfg: JobConfig, world: int, rank: int, expected_units: list[str] | None = None
) -> None:
    dims, parts, stage_ids = _build_rank(cfg, world, rank)
    args = MODELS[cfg.model.name].flavors[cfg.model.flavor]
    coords = dims.coordinates()
    tp, fsdp = dims.tp, dims.dp_shard * dims.cp
    fsdp_rank = coords["dp_shard"] * dims.cp + coords["cp"]
    sizes = (args.dim, args.hidden_dim, args.n_heads, args.kv_heads, args.head_dim)

    names: list[str] = []
    local_count = 0
    for part in parts:
        for raw, p in part.named_parameters():
            fqn = _clean(raw)
            names.append(fqn)
            if fqn.startswith("layers.") and cfg.activation_checkpoint.mode != "none":
                assert "_checkpoint_wrapped_module." in raw, f"{raw}: block not checkpointed"

            assert p.device.type == "meta", f"{fqn} was materialized"
            assert isinstance(p, DTensor), f"{fqn} is not sharded"
            tp_dim = _TOP_TP_DIM.get(fqn, _BLOCK_TP_DIM.get(fqn.split(".", 2)[-1]))
            want = _expected_local(_global_shape(fqn, *sizes), tp_dim, tp, fsdp, fsdp_rank)
            got = tuple(p.to_local().shape)
            assert got == want, f"rank {rank} {fqn}: local shard {got}, expected {want}"
            assert tuple(p.shape) == _global_shape(fqn, *sizes), f"{fqn}: global shape {p.shape}"
            # The mesh dims the parameter is spread over: FSDP's, then TP's (if any).
            mesh_names = p.device_mesh.mesh_dim_names or ()
            # FSDP shards dim 0 (a _StridedShard when TP already split dim 0).
            assert mesh_names[0] == "dp_shard_cp" and getattr(p.placements[0], "dim", None) == 0
            if tp > 1:
                assert mesh_names[-1] == "tp"
                tp_place = p.placements[-1]
                assert (tp_dim is None and tp_place.is_replicate()) or (
                    isinstance(tp_place, Shard) and tp_place.dim == tp_dim
                ), f"{fqn}: TP placement {tp_place}, expected dim {tp_dim}"
            local_count += p.to_local().numel()

    if cfg.quantize.dense.float8.enable:
        # Every block linear is a float8 linear; the output projection (filter_fqns) is not.
        from torchao.float8.float8_linear import Float8Linear

        linears = {
            _clean(n): type(m).__name__
            for part in parts
            for n, m in part.named_modules()
            if isinstance(m, nn.Linear)
        }
        assert linears, "no linear layers"
        for n, kind in linears.items():
            want_f8 = n.startswith("layers.")
            assert (kind == Float8Linear.__name__) == want_f8, f"{n} is a {kind}"

    # Which parameters this rank holds: the whole model, or its pipeline stages' layers.
    if expected_units is None:
        layer_ids = list(range(args.n_layers))
        top = ["tok_embeddings.weight", "norm.weight", "output.weight"]
    else:
        layer_ids = [int(u.split(".")[1]) for u in expected_units if u.startswith("layers.")]
        top = (["tok_embeddings.weight"] if "tok_embeddings" in expected_units else []) + (
            ["norm.weight", "output.weight"] if "norm" in expected_units else []
        )
    want_names = top + [f"layers.{i}.{s}" for i in layer_ids for s in _BLOCK_TP_DIM]
    assert sorted(names) == sorted(want_names)

    # The count, from the closed form: matrices split tp x fsdp ways, norms fsdp ways.
    d, h = args.dim, args.hidden_dim
    q, kv = args.n_heads * args.head_dim, args.kv_heads * args.head_dim
    block_matrices = 2 * d * q + 2 * d * kv + 3 * d * h
    expected = len(layer_ids) * (block_matrices // (tp * fsdp) + 2 * d // fsdp)
    expected += sum(VOCAB * d // (tp * fsdp) for n in top if n != "norm.weight")
    expected += d // fsdp if "norm.weight" in top else 0
    print(f"rank {rank} stages {stage_ids}: {local_count:,} parameters (expected {expected:,})")
    assert local_count == expected


def test_llama3_8b_fsdp8(fake_rank: None) -> None:
    cfg = _load("llama3_8b.toml", 8)
    assert cfg.compile.enable and cfg.activation_checkpoint.mode == "selective"
    _check_rank(cfg, 8, rank=5)
    # The arithmetic spelled out for one weight: w1 is [14336, 4096], FSDP 8 -> [1792, 4096].
    assert _expected_local((14336, 4096), 0, 1, 8, 5) == (1792, 4096)


def test_llama3_70b_fsdp32_tp8(fake_rank: None) -> None:
    cfg = _load("llama3_70b.toml", 256)
    assert cfg.activation_checkpoint.mode == "full"
    # Rank 203 = dp_shard 25, tp 3 (tp innermost).
    _check_rank(cfg, 256, rank=203)
    # wq: [8192, 8192] -> TP 8 -> [1024, 8192] -> FSDP 32 -> [8192/8/32, 8192] = [32, 8192].
    assert _expected_local((8192, 8192), 0, 8, 32, 25) == (32, 8192)


@pytest.mark.usefixtures("newest_torch_rules")  # PP x TP: validated as on torch >= 2.13
@pytest.mark.parametrize("rank", [0, 511])
def test_llama3_405b_3d(fake_rank: None, rank: int) -> None:
    cfg = _load("llama3_405b.toml", 512)
    plan = pipeline_stages(cfg)
    assert plan is not None and plan.num_stages == 16 and plan.n_microbatches == 16
    pp_rank = rank // 64  # 64 = dp_shard 8 x tp 8 ranks per pipeline rank
    stages = [pp_rank, pp_rank + 8]  # looped placement: stage s on pp rank s % 8
    assert plan.stage_ids(pp_rank) == stages
    # 128 units (embedding, 126 blocks, head) in 16 stages of 8.
    units = ["tok_embeddings", *(f"layers.{i}" for i in range(126)), "norm"]
    mine = [u for s in stages for u in units[8 * s : 8 * s + 8]]
    _check_rank(cfg, 512, rank=rank, expected_units=mine)
