"""ParallelDims: the single source of truth for parallel degrees and device meshes.

Degrees are validated with pure arithmetic (no process group) so that bad layouts fail before
any rank starts communicating. ``build_mesh`` then creates one world mesh with the named axes
``pp, dp_replicate, dp_shard, cp, tp`` (outermost to innermost: TP stays inside a node, PP spans
nodes) and flattens the combinations that features need:

- ``dp``          = dp_replicate x dp_shard      data loading (each coordinate reads its own shard)
- ``dp_shard_cp`` = dp_shard x cp                FSDP parameter sharding
- ``dp_cp``       = dp_replicate x dp_shard x cp loss and token-count reduction

Every axis exists even at degree 1, so ``mesh["tp"]`` is always valid; features check the
``*_enabled`` flags before using an axis.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import Parallelism

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
_FIELD = {
    "dp_replicate": "parallelism.data_parallel_replicate_degree",
    "dp_shard": "parallelism.data_parallel_shard_degree",
    "cp": "parallelism.context_parallel_degree",
    "tp": "parallelism.tensor_parallel_degree",
    "pp": "parallelism.pipeline_parallel_degree",
}


def _ranks(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, ascending: the degrees an axis of ``n`` ranks allows."""
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class BatchSizes:
    """Sequences per optimizer step and how they are made: ``global_batch_size =
    local_batch_size x dp_degree x grad_accum_steps``. The trainer, validation, explain, the
    estimator and the planner all take it from ``ParallelDims.batch_sizes``."""

    local_batch_size: int
    dp_degree: int
    global_batch_size: int
    grad_accum_steps: int

    def describe(self) -> str:
        return (
            f"global batch {self.global_batch_size} sequences = local {self.local_batch_size} x "
            f"dp {self.dp_degree} x grad accum {self.grad_accum_steps}"
        )


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    world_size: int
    ep: int = 1
    """Expert parallel: a split of ``dp_shard x cp`` (the ``ep`` and ``efsdp`` meshes,
    docs/parallelisms.md)."""
    fsdp_cpu_offload: bool = False
    """FSDP CPU offload asks for FSDP even on a 1-rank ``dp_shard_cp`` mesh (docs/memory.md)."""
    _mesh: DeviceMesh | None = field(default=None, init=False, repr=False)
    _flat: dict[str, DeviceMesh] = field(default_factory=dict, init=False, repr=False)

    @classmethod
    def from_config(cls, p: Parallelism, world_size: int) -> ParallelDims:
        """The degrees of a ``[parallelism]`` section on ``world_size`` ranks (validated)."""
        return cls(
            dp_replicate=p.data_parallel_replicate_degree,
            dp_shard=p.data_parallel_shard_degree,
            cp=p.context_parallel_degree,
            tp=p.tensor_parallel_degree,
            pp=p.pipeline_parallel_degree,
            world_size=world_size,
            ep=p.expert_parallel_degree,
            fsdp_cpu_offload=p.fsdp_cpu_offload,
        )

    def __post_init__(self) -> None:
        self._validate()

    def _validate(self) -> None:
        degrees = {a: getattr(self, a) for a in AXES}
        for axis, d in degrees.items():
            if d < 1 and not (axis == "dp_shard" and d == -1):
                allowed = (
                    "an integer >= 1, or -1 for the rest"
                    if axis == "dp_shard"
                    else "an integer >= 1"
                )
                raise ConfigError(_FIELD[axis], d, f"must be {allowed}", "set a positive degree")
        n = self.world_size
        fixed = {a: d for a, d in degrees.items() if a != "dp_shard"}
        others = math.prod(fixed.values())
        if n % others != 0:
            # Blame an axis that cannot divide the world size on its own, else the innermost
            # enabled one, and list the values it could take with the other degrees as given.
            enabled = [a for a, d in fixed.items() if d > 1]
            axis = next((a for a in enabled if n % fixed[a] != 0), enabled[-1])
            given = {a: d for a, d in degrees.items() if d > 1}  # dp_shard=-1 adapts
            rest = {a: d for a, d in given.items() if a != axis}
            room = n // math.prod(rest.values()) if n % math.prod(rest.values()) == 0 else 1
            beside = f" with {self._product_text(rest, total=False)}" if rest else ""
            raise ConfigError(
                _FIELD[axis],
                degrees[axis],
                f"{_ranks(n)} cannot hold {self._product_text(given)}",
                f"valid {axis} for {_ranks(n)}{beside}: {', '.join(map(str, divisors(room)))}",
            )
        rest_of_world = n // others
        if self.dp_shard == -1:
            self.dp_shard = rest_of_world
        elif self.dp_shard != rest_of_world:
            shown = {a: d for a, d in fixed.items() if d > 1}
            options = divisors(rest_of_world)
            smaller = options[-2] if len(options) > 1 else None
            example = (
                f"; below {rest_of_world}, data_parallel_replicate_degree makes up the rest, e.g. "
                f"dp_replicate={fixed['dp_replicate'] * rest_of_world // smaller} x "
                f"dp_shard={smaller}"
                if smaller is not None
                else ""
            )
            raise ConfigError(
                _FIELD["dp_shard"],
                self.dp_shard,
                f"{_ranks(n)} cannot hold {self._product_text(degrees)}; "
                f"the degrees must multiply to {n}",
                f"valid dp_shard for {self._product_text(shown, total=False) or 'no other axes'}: "
                f"{', '.join(map(str, options))} (-1 takes the rest: {rest_of_world}{example})",
            )

    @staticmethod
    def _product_text(degrees: dict[str, int], total: bool = True) -> str:
        """e.g. 'dp_shard=3 x tp=2 (= 6 ranks)'; degree-1 axes are left out."""
        shown = " x ".join(f"{a}={d}" for a, d in degrees.items() if d != 1)
        if not total:
            return shown
        ranks = math.prod(abs(d) for d in degrees.values())
        return f"{shown or 'all degrees 1'} (= {_ranks(ranks)})"

    # ------------------------------------------------------------------ flags
    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def fsdp_enabled(self) -> bool:
        """Parameters are sharded (FSDP or HSDP) over dp_shard x cp; under CPU offload also when
        that is one rank (FSDP on a 1-rank mesh keeps the whole parameters on the host)."""
        return self.dp_shard * self.cp > 1 or self.fsdp_cpu_offload

    @property
    def ddp_enabled(self) -> bool:
        """Pure replication (DDP): dp_replicate > 1 with nothing to shard over."""
        return self.dp_replicate > 1 and not self.fsdp_enabled

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def efsdp(self) -> int:
        """Under expert parallel, the ranks of ``dp_shard x cp`` beside ``ep``: the experts'
        FSDP degree (1: the experts are not sharded by FSDP)."""
        return self.dp_shard * self.cp // self.ep

    @property
    def dp_degree(self) -> int:
        """Data-parallel degree seen by the data loader (distinct batches per step)."""
        return self.dp_replicate * self.dp_shard

    @property
    def non_data_parallel_size(self) -> int:
        return self.cp * self.tp * self.pp

    def batch_sizes(self, local_batch_size: int, global_batch_size: int) -> BatchSizes:
        """The batch sizes of ``training.local_batch_size`` / ``global_batch_size`` (-1: no
        accumulation) on these degrees; ConfigError when the global batch does not divide."""
        per_step = local_batch_size * self.dp_degree
        if global_batch_size == -1:
            global_batch_size = per_step
        if global_batch_size <= 0 or global_batch_size % per_step != 0:
            raise ConfigError(
                "training.global_batch_size",
                global_batch_size,
                f"must be -1 or a positive multiple of local_batch_size x dp degree = "
                f"{local_batch_size} x {self.dp_degree} = {per_step}",
                f"use {per_step} (no accumulation) or a multiple such as {2 * per_step}",
            )
        return BatchSizes(
            local_batch_size, self.dp_degree, global_batch_size, global_batch_size // per_step
        )

    # ------------------------------------------------------------------ meshes
    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Create the world mesh and its flattened views (needs an initialized process group)."""
        shape = tuple(getattr(self, a) for a in AXES)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=AXES)
        # torch asks callers to keep the flattened meshes rather than slice them from the root.
        self._flat = {
            "dp": mesh["dp_replicate", "dp_shard"]._flatten(mesh_dim_name="dp"),
            "dp_shard_cp": mesh["dp_shard", "cp"]._flatten(mesh_dim_name="dp_shard_cp"),
            "dp_cp": mesh["dp_replicate", "dp_shard", "cp"]._flatten(mesh_dim_name="dp_cp"),
        }
        if self.ep > 1:  # dp_shard x cp = efsdp x ep, ep innermost (docs/parallelisms.md)
            split = self._flat["dp_cp"]._unflatten(
                0, (self.dp_replicate, self.efsdp, self.ep), ("ep_replicate", "efsdp", "ep")
            )
            self._flat.update(ep=split["ep"], efsdp=split["efsdp"])
            # FSDP of the experts: HSDP (replicated across dp_replicate) or FSDP over efsdp.
            if self.dp_replicate_enabled:
                self._flat["expert_fsdp"] = split["ep_replicate", "efsdp"]
            else:
                self._flat["expert_fsdp"] = split["efsdp"]
        self._mesh = mesh
        return mesh

    def get_mesh(self, name: str) -> DeviceMesh:
        """A 1-D mesh: one of AXES, or a flattened view (dp, dp_shard_cp, dp_cp), or with expert
        parallel ``ep`` / ``efsdp`` (the two factors of dp_shard x cp) and ``expert_fsdp`` (the
        mesh FSDP shards the experts on: ``efsdp``, or 2-D ``(ep_replicate, efsdp)`` under HSDP,
        ``ep_replicate`` being the dp_replicate ranks)."""
        if name in self._flat:
            return self._flat[name]
        return self.world_mesh[name]

    def fsdp_mesh(self) -> DeviceMesh:
        """The mesh FSDP2 shards parameters on: 1-D ``dp_shard_cp``, or for HSDP the 2-D
        ``(dp_replicate, dp_shard_cp)`` (replicate across, shard within)."""
        shard = self.get_mesh("dp_shard_cp")
        if not self.dp_replicate_enabled:
            return shard
        # Slicing a flattened axis out of the root mesh is deprecated; joining the two 1-D
        # meshes reuses their process groups and keeps the root, which FSDP2 x TP requires.
        return DeviceMesh._concatenate([self.world_mesh["dp_replicate"], shard])

    @property
    def world_mesh(self) -> DeviceMesh:
        if self._mesh is None:
            raise RuntimeError("ParallelDims.build_mesh() has not been called")
        return self._mesh

    def coordinates(self) -> dict[str, int]:
        """This rank's index along each axis."""
        coord = self.world_mesh.get_coordinate()
        assert coord is not None, "this rank is not part of the world mesh"
        return dict(zip(AXES, coord))

    def describe_rank(self, rank: int) -> str:
        """e.g. 'rank 7 pp=1 dp_shard=1 tp=1': the enabled axes and this rank's place on them."""
        coords = self.coordinates()
        parts = [f"{a}={coords[a]}" for a in AXES if getattr(self, a) > 1]
        return " ".join([f"rank {rank}"] + parts)
