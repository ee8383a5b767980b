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

from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torchtitan.config.errors import ConfigError

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
_FIELD = {
    "dp_replicate": "parallelism.data_parallel_replicate_degree",
    "dp_shard": "parallelism.data_parallel_shard_degree",
    "cp": "parallelism.context_parallel_degree",
    "tp": "parallelism.tensor_parallel_degree",
    "pp": "parallelism.pipeline_parallel_degree",
}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    world_size: int
    _mesh: DeviceMesh | None = field(default=None, init=False, repr=False)
    _flat: dict[str, DeviceMesh] = field(default_factory=dict, init=False, repr=False)

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
        others = 1
        for axis, d in degrees.items():
            if axis != "dp_shard":
                others *= d
        if self.world_size % others != 0:
            bad = [
                a
                for a, d in degrees.items()
                if a != "dp_shard" and d > 1 and self.world_size % d != 0
            ]
            axis = (
                bad[0] if bad else next(a for a, d in degrees.items() if a != "dp_shard" and d > 1)
            )
            raise ConfigError(
                _FIELD[axis],
                degrees[axis],
                f"{self.world_size} ranks cannot hold {self._product_text(degrees)}",
                f"use degrees whose product divides {self.world_size}; "
                f"valid {axis} for {self.world_size} ranks: {', '.join(map(str, _divisors(self.world_size)))}",
            )
        rest = self.world_size // others
        if self.dp_shard == -1:
            self.dp_shard = rest
        elif self.dp_shard != rest:
            raise ConfigError(
                _FIELD["dp_shard"],
                self.dp_shard,
                f"{self.world_size} ranks cannot hold {self._product_text(degrees)}",
                f"with the other degrees as given, dp_shard must be {rest} (or -1 for the rest); "
                f"dp_shard values that fit {self.world_size} ranks when another axis takes the "
                f"remaining factor: {', '.join(str(d) for d in _divisors(rest))}",
            )

    @staticmethod
    def _product_text(degrees: dict[str, int]) -> str:
        shown = " x ".join(f"{a}={d}" for a, d in degrees.items() if d != 1)
        total = 1
        for d in degrees.values():
            total *= abs(d)
        return f"{shown or 'all degrees 1'} (= {total} ranks)"

    # ------------------------------------------------------------------ flags
    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def fsdp_enabled(self) -> bool:
        """Parameters are sharded (FSDP or HSDP) over dp_shard x cp."""
        return self.dp_shard * self.cp > 1

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
    def dp_degree(self) -> int:
        """Data-parallel degree seen by the data loader (distinct batches per step)."""
        return self.dp_replicate * self.dp_shard

    @property
    def non_data_parallel_size(self) -> int:
        return self.cp * self.tp * self.pp

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
        self._mesh = mesh
        return mesh

    def get_mesh(self, name: str) -> DeviceMesh:
        """A 1-D mesh: one of AXES, or a flattened view (dp, dp_shard_cp, dp_cp)."""
        if name in self._flat:
            return self._flat[name]
        return self.world_mesh[name]

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
