"""Context parallel (docs/context_parallel.md): the sequence of every sample split over ``cp``.

* ``core.py``: the head-tail layout, the all-gather attention core, ``apply_cp`` and the
  trainer's per-batch sharding (``ContextParallel``);
* ``layout.py``: the load balancers (which tokens each rank holds) and their attention cost;
* ``ring.py``: ring attention with the document (block-causal) mask.
"""

from torchtitan.distributed.context_parallel.core import (
    QUERY_BLOCK,
    AllGatherKVAttention,
    ContextParallel,
    apply_cp,
    chunk_order,
    load_balanced_positions,
    shard_sequence,
    unshard_sequence,
)

__all__ = [
    "QUERY_BLOCK",
    "AllGatherKVAttention",
    "ContextParallel",
    "apply_cp",
    "chunk_order",
    "load_balanced_positions",
    "shard_sequence",
    "unshard_sequence",
]
