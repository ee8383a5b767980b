"""ParallelDims and the parallelism config rules.

Tier 1 (pure arithmetic): degree validation and its messages, TP/async-TP config rules,
the FSDP reshard policy. Tier 2 (one process, torch's ``fake`` backend): the meshes of the
seed's 8B, 70B and 405B layouts on 8, 256 and 512 ranks, every submesh's shape and the rank
group this rank belongs to on every axis, checked against coordinates computed independently.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from torchtitan.config import ConfigError, JobConfig, parse_args
from torchtitan.distributed.data_parallel import reshard_policy
from torchtitan.distributed.parallel_dims import AXES, ParallelDims
from torchtitan.preflight.validate import validate_config

ROOT = Path(__file__).resolve().parents[2]
DEBUG_TOML = str(ROOT / "train_configs" / "debug_model.toml")


def dims(
    world: int, dp_shard: int = -1, dp_replicate: int = 1, cp: int = 1, tp: int = 1, pp: int = 1
) -> ParallelDims:
    return ParallelDims(
        dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, pp=pp, world_size=world
    )


# ---------------------------------------------------------------- tier 1: degrees
def test_dp_shard_takes_the_rest_and_flags() -> None:
    d = dims(16, tp=2, pp=2)
    assert d.dp_shard == 4 and d.dp_degree == 4 and d.non_data_parallel_size == 4
    assert d.fsdp_enabled and not d.ddp_enabled and d.tp_enabled and d.pp_enabled
    d = dims(4, dp_shard=1, dp_replicate=4)
    assert d.ddp_enabled and not d.fsdp_enabled and d.dp_degree == 4
    d = dims(4, dp_shard=2, dp_replicate=2)  # HSDP
    assert d.fsdp_enabled and d.dp_replicate_enabled and not d.ddp_enabled
    d = dims(1)
    assert not (d.fsdp_enabled or d.ddp_enabled or d.tp_enabled) and d.dp_shard == 1


def test_error_names_the_field_and_the_valid_values() -> None:
    # The example, word for word in the message.
    with pytest.raises(ConfigError) as e:
        dims(8, dp_shard=3, tp=2)
    assert e.value.field == "parallelism.data_parallel_shard_degree" and e.value.value == 3
    assert "8 ranks cannot hold dp_shard=3 x tp=2" in str(e.value)
    assert "valid dp_shard for tp=2: 1, 2, 4" in str(e.value)
    assert "-1 takes the rest: 4" in str(e.value)

    with pytest.raises(ConfigError) as e:
        dims(8, tp=3, pp=2)
    assert e.value.field == "parallelism.tensor_parallel_degree"
    assert "8 ranks cannot hold pp=2 x tp=3" in str(e.value)
    assert "valid tp for 8 ranks with pp=2: 1, 2, 4" in str(e.value)

    with pytest.raises(ConfigError) as e:  # each divides 8, the product does not
        dims(8, tp=4, pp=4)
    assert "16 ranks" in str(e.value) and "valid tp for 8 ranks with pp=4: 1, 2" in str(e.value)

    for bad in ({"tp": 0}, {"dp_shard": -2}, {"pp": -1}):
        with pytest.raises(ConfigError, match="must be an integer >= 1"):
            dims(8, **bad)


@pytest.mark.parametrize(
    "policy, pp, expected",
    [
        ("default", False, True),
        ("default", True, False),
        ("always", True, True),
        ("never", False, False),
    ],
)
def test_reshard_after_forward_policy(policy: str, pp: bool, expected: bool) -> None:
    assert reshard_policy(policy, pp) is expected  # type: ignore[arg-type]


# ---------------------------------------------------------------- tier 1: TP config rules
def cfg_for(*argv: str) -> JobConfig:
    return parse_args(["--job.config_file", DEBUG_TOML, *argv])


def test_tp_degrees_the_model_can_take() -> None:
    validate_config(cfg_for("--parallelism.tensor_parallel_degree", "2"), world_size=8)
    validate_config(
        cfg_for("--model.flavor", "70B", "--parallelism.tensor_parallel_degree", "8"),
        world_size=256,
    )
    # GQA: 70B has 64 query heads but 8 key/value heads, so TP 16 cannot split them.
    with pytest.raises(ConfigError) as e:
        validate_config(
            cfg_for("--model.flavor", "70B", "--parallelism.tensor_parallel_degree", "16"),
            world_size=256,
        )
    assert e.value.field == "parallelism.tensor_parallel_degree" and e.value.value == 16
    assert "n_kv_heads=8" in str(e.value) and "1, 2, 4, 8" in str(e.value)
    # The debug model has 16 heads: TP 32 is rejected on n_heads.
    with pytest.raises(ConfigError, match="n_heads=16"):
        validate_config(cfg_for("--parallelism.tensor_parallel_degree", "32"), world_size=32)
    # Sequence parallel shards the sequence.
    with pytest.raises(ConfigError) as e:
        validate_config(
            cfg_for("--parallelism.tensor_parallel_degree", "4", "--training.seq_len", "66"),
            world_size=4,
        )
    assert e.value.field == "training.seq_len" and "multiple of 4" in str(e.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_async_tp_needs_cuda() -> None:
    seed = [
        "--parallelism.data_parallel_shard_degree",
        "4",
        "--parallelism.tensor_parallel_degree",
        "2",
        "--parallelism.enable_async_tensor_parallel",
        "--compile.enable",
    ]
    with pytest.raises(ConfigError) as e:
        validate_config(cfg_for(*seed), world_size=8)
    assert e.value.field == "parallelism.enable_async_tensor_parallel"
    assert "needs CUDA" in str(e.value)
    # The same line without async TP is valid on CPU (the "done when" command).
    validate_config(cfg_for(*seed[:4]), world_size=8)


# ---------------------------------------------------------------- tier 2: meshes, fake backend
def expected_group(shape: dict[str, int], rank: int, axes: tuple[str, ...]) -> list[int]:
    """Ranks sharing ``rank``'s coordinates on every axis not in ``axes``, ordered row-major
    over ``axes`` (the world mesh is ``arange(world).reshape(shape)`` in AXES order)."""
    sizes = [shape[a] for a in AXES]
    strides = [math.prod(sizes[i + 1 :]) for i in range(len(sizes))]
    coord = {a: (rank // s) % n for a, s, n in zip(AXES, strides, sizes)}
    group = []
    for values in itertools.product(*(range(shape[a]) for a in axes)):
        c = {**coord, **dict(zip(axes, values))}
        group.append(sum(c[a] * s for a, s in zip(AXES, strides)))
    return group


FLATTENED = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}

LAYOUTS = {
    # name: (world size, degrees), the seed's configurations
    "8B FSDP 8": (8, {"dp_shard": -1}),
    "70B FSDP 32 x TP 8": (256, {"dp_shard": 32, "tp": 8}),
    "405B FSDP 8 x TP 8 x PP 8": (512, {"dp_shard": 8, "tp": 8, "pp": 8}),
    "HSDP 2 x 2 x CP 2 x TP 2": (16, {"dp_replicate": 2, "dp_shard": 2, "cp": 2, "tp": 2}),
}


@pytest.fixture
def fake_world() -> Iterator[Callable[[int, int], None]]:
    """Starts a fake-backend world as a given rank; destroys it after the test."""

    def start(rank: int, world: int) -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("which_rank", ["first", "middle", "last"])
def test_mesh_layout(fake_world, layout: str, which_rank: str) -> None:
    world, degrees = LAYOUTS[layout]
    rank = {"first": 0, "middle": world // 2 + 3, "last": world - 1}[which_rank]
    fake_world(rank, world)
    d = dims(world, **degrees)
    mesh = d.build_mesh("cpu")
    shape = {a: getattr(d, a) for a in AXES}
    assert math.prod(shape.values()) == world

    assert mesh.mesh_dim_names == AXES
    assert mesh.mesh.tolist() == torch.arange(world).reshape(tuple(shape.values())).tolist()
    for axis in AXES:
        sub = d.get_mesh(axis)
        assert sub.size() == shape[axis], axis
        assert sub.mesh.tolist() == expected_group(shape, rank, (axis,)), axis
        if shape[axis] > 1:
            ranks = dist.get_process_group_ranks(sub.get_group())
            assert ranks == expected_group(shape, rank, (axis,)), axis
    for name, parts in FLATTENED.items():
        flat = d.get_mesh(name)
        want = expected_group(shape, rank, parts)
        assert flat.size() == len(want) and flat.mesh.tolist() == want, name
        if len(want) > 1:
            assert dist.get_process_group_ranks(flat.get_group()) == want, name
    # FSDP's mesh: 1-D dp_shard x cp, or 2-D (dp_replicate, dp_shard_cp) for HSDP.
    fsdp = d.fsdp_mesh()
    if d.dp_replicate_enabled:
        assert fsdp.mesh_dim_names == ("dp_replicate", "dp_shard_cp")
        rows = [
            expected_group(shape, r, ("dp_shard", "cp"))
            for r in expected_group(shape, rank, ("dp_replicate",))
        ]
        assert fsdp.mesh.tolist() == rows
    else:
        assert fsdp.mesh.tolist() == expected_group(shape, rank, ("dp_shard", "cp"))
    # The 2-D slice FSDP x TP composes on.
    if d.tp_enabled:
        two_d = mesh["dp_shard", "tp"]
        assert two_d.mesh.shape == (shape["dp_shard"], shape["tp"])
    coords = d.coordinates()
    assert d.get_mesh("tp").get_local_rank() == coords["tp"]
    assert d.describe_rank(rank).startswith(f"rank {rank} ")


def test_describe_rank_names_the_last_stage(fake_world) -> None:
    fake_world(511, 512)
    d = dims(512, dp_shard=8, tp=8, pp=8)
    d.build_mesh("cpu")
    assert d.describe_rank(511) == "rank 511 pp=7 dp_shard=7 tp=7"


def test_async_tp_needs_tp_and_compile_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rules after the CUDA check, with a GPU pretended (nothing is run on it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("TORCHTITAN_DEVICE", "cuda")  # the suite pins CPU (tests/conftest.py)
    flag = "--parallelism.enable_async_tensor_parallel"
    with pytest.raises(ConfigError, match="needs tensor_parallel_degree >= 2"):
        validate_config(cfg_for(flag, "--compile.enable"), world_size=2)
    with pytest.raises(ConfigError, match="needs compile.enable") as e:
        validate_config(cfg_for(flag, "--parallelism.tensor_parallel_degree", "2"), world_size=2)
    assert e.value.field == "parallelism.enable_async_tensor_parallel"
    validate_config(
        cfg_for(flag, "--parallelism.tensor_parallel_degree", "2", "--compile.enable"),
        world_size=2,
    )


@pytest.mark.parametrize("dp_replicate, dp_shard", [(1, 4), (2, 2), (4, 1)])
def test_data_parallel_composes_with_tp_on_one_mesh(fake_world, dp_replicate, dp_shard) -> None:
    """FSDP x TP (2-D), HSDP x TP (3-D) and DDP x TP parameters live on one mesh that joins
    the data axes and tp (the meta model is enough: nothing is communicated)."""
    import dataclasses

    from torch.distributed.tensor import Replicate, Shard

    from torchtitan.distributed.data_parallel import apply_ddp, apply_fsdp
    from torchtitan.distributed.tensor_parallel import apply_tp
    from torchtitan.models.llama3.args import LLAMA3_FLAVORS
    from torchtitan.models.llama3.model import Transformer
    from torchtitan.models.llama3.parallel_plan import llama3_parallel_plan

    fake_world(5, 8)
    d = dims(8, dp_shard=dp_shard, dp_replicate=dp_replicate, tp=2)
    d.build_mesh("cpu")
    with torch.device("meta"):
        args = dataclasses.replace(LLAMA3_FLAVORS["debugmodel"], max_seq_len=64)
        model = Transformer(args)
    tp_plan = llama3_parallel_plan(args).tensor_parallel
    apply_tp(model, model.layers, d.get_mesh("tp"), tp_plan, loss_parallel=True)
    if d.fsdp_enabled:
        units = list(model.layers.values())
        apply_fsdp(model, units, d.fsdp_mesh(), torch.float32, torch.float32, True)
    else:
        apply_ddp(model, d.world_mesh["dp_replicate"], torch.float32, torch.float32)
    wq = model.layers["0"].attention.wq.weight  # colwise: Shard(0) on tp
    norm = model.layers["0"].attention_norm.weight  # sequence parallel: replicated on tp
    names = wq.device_mesh.mesh_dim_names
    assert (
        names
        == {
            (1, 4): ("dp_shard_cp", "tp"),
            (2, 2): ("dp_replicate", "dp_shard_cp", "tp"),
            (4, 1): ("dp_replicate", "tp"),
        }[(dp_replicate, dp_shard)]
    )
    assert wq.placements[-1] == Shard(0) and norm.placements[-1] == Replicate()
    if dp_replicate > 1:
        assert wq.placements[0] == Replicate()
    assert wq.to_local().shape[0] == 256 // (2 * dp_shard)
