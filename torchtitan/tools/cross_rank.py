"""Min and max of a few per-rank scalars over all ranks, with the rank of each, in one all-reduce.

One logging rank cannot show a straggler or a memory outlier elsewhere; this view can. Each value
is quantized to an integer (``scale`` units: e.g. microseconds, KiB) and packed into an int64 key
with the rank in the low bits, so a single MAX all-reduce returns, for every value, both the
largest value and the rank holding it. The minimum rides in the same all-reduce as the maximum of
``(LIMIT - q)``. Ties go to the highest rank. Negative values are clamped to 0 (these are times
and sizes), values beyond ``2**43 - 1`` units are clamped to that.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

__all__ = ["RANK_BITS", "decode", "encode", "reduce_extremes"]

RANK_BITS = 20  # up to 1,048,576 ranks
_VALUE_BITS = 63 - RANK_BITS
LIMIT = (1 << _VALUE_BITS) - 1
_RANK_MASK = (1 << RANK_BITS) - 1


def _quantize(value: float, scale: float) -> int:
    q = round(value * scale) if value == value else 0  # NaN -> 0
    return min(max(int(q), 0), LIMIT)


def encode(values: Mapping[str, tuple[float, float]], rank: int) -> list[int]:
    """``{name: (value, scale)}`` -> ``[max key, min key] * len(values)`` for a MAX all-reduce."""
    if not 0 <= rank <= _RANK_MASK:
        raise ValueError(f"rank {rank} does not fit in {RANK_BITS} bits")
    keys: list[int] = []
    for value, scale in values.values():
        q = _quantize(value, scale)
        keys.append((q << RANK_BITS) | rank)
        keys.append(((LIMIT - q) << RANK_BITS) | rank)
    return keys


def decode(names: list[str], scales: list[float], keys: list[int]) -> dict[str, float | int]:
    """Reduced keys -> ``{name_max, name_max_rank, name_min, name_min_rank}`` per name."""
    out: dict[str, float | int] = {}
    for i, (name, scale) in enumerate(zip(names, scales)):
        kmax, kmin = keys[2 * i], keys[2 * i + 1]
        out[f"{name}_max"] = (kmax >> RANK_BITS) / scale
        out[f"{name}_max_rank"] = kmax & _RANK_MASK
        out[f"{name}_min"] = (LIMIT - (kmin >> RANK_BITS)) / scale
        out[f"{name}_min_rank"] = kmin & _RANK_MASK
    return out


def reduce_extremes(
    values: Mapping[str, tuple[float, float]],
    *,
    rank: int,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
) -> dict[str, float | int]:
    """Min/max over the ranks of ``group`` (default: all) of each ``{name: (value, scale)}``,
    and the rank of each; one int64 MAX all-reduce (none when there is one rank)."""
    keys = encode(values, rank)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        t = torch.tensor(keys, dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        keys = [int(k) for k in t.tolist()]
    return decode(list(values), [scale for _, scale in values.values()], keys)
