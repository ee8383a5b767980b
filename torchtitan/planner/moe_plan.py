"""Expert parallel in the planner (docs/planning.md, "MoE"): which ``expert_parallel_degree``
values a layout may take, and the step-time terms MoE blocks add.

* **Choices**: every divisor of ``dp_shard x cp`` that ``preflight/validate_moe.py`` accepts for
  the layout (it must divide ``dp_shard x cp`` and the expert count): the planner asks the
  validator itself, so the two cannot disagree. Dense models get ``ep = 1`` only.
* **Compute**: the model's ``flops_per_token`` already counts the active parameters (top-k
  routed + shared experts). Under TP an MoE block runs whole on every TP rank (the experts are
  replicated over TP, docs/moe.md), so its expert FLOPs are not divided by ``tp``:
  ``moe_tp`` adds the ``tp - 1`` extra copies.
* **All-to-all**: per MoE layer and micro-step, a dispatch and a combine forward, the same two
  backward, and again the forward pair for every recomputed block; each moves
  ``moe_memory.all_to_all_bytes`` (the function ``--job.explain`` prints), over the intra-node
  bandwidth when ``ep x cp x tp`` ranks fit in a node (``ep`` is the innermost part of
  ``dp_shard x cp``), the inter-node one otherwise. Not overlapped with compute.
* **FSDP**: the experts are gathered (and their gradients reduced) over ``efsdp = dp_shard x cp /
  ep`` ranks, ``E / ep`` of them per layer; the other weights over ``dp_shard x cp`` as before.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims, divisors
from torchtitan.models import flavor_args
from torchtitan.planner.moe_memory import all_to_all_bytes, moe_of
from torchtitan.preflight.validate_moe import validate_expert_parallel

__all__ = [
    "active_block_params",
    "ep_choices",
    "expert_params",
    "moe_op_recompute_fraction",
    "moe_step_terms",
]


def expert_params(a: Any) -> int:
    """Routed-expert parameters of the whole model (0 for a dense one)."""
    moe = moe_of(a)
    if moe is None:
        return 0
    return int(a.n_moe_layers) * moe.num_experts * 3 * a.dim * moe.expert_dim


def active_block_params(a: Any, dense_block_params: int) -> float:
    """Parameters one token runs through in an average block (the routed experts it uses,
    not all of them); ``dense_block_params`` for a dense model."""
    moe = moe_of(a)
    if moe is None:
        return float(dense_block_params)
    active = a.num_params(exclude_embedding=True, active=True)
    output = 0 if a.tie_word_embeddings else a.vocab_size * a.dim
    return (active - output - a.dim) / a.n_layers  # less the final norm


def moe_op_recompute_fraction(a: Any) -> float | None:
    """Recomputed share of an MoE block's forward FLOPs under op-level AC (None: dense). The
    policy saves every second ``mm`` (wq, wv, the router, the shared experts' w3); the grouped
    GEMMs are no ``mm``, so the routed experts run again, with wk, wo and the shared w1, w2."""
    moe = moe_of(a)
    if moe is None:
        return None
    d, q, kv = a.dim, a.n_heads * a.head_dim, a.kv_heads * a.head_dim
    s = moe.num_shared_experts * moe.expert_dim
    routed = moe.top_k * 3 * d * moe.expert_dim
    recomputed = d * kv + q * d + routed + 2 * d * s
    return recomputed / (2 * d * q + 2 * d * kv + moe.num_experts * d + routed + 3 * d * s)


def ep_choices(
    cfg: JobConfig, world_size: int, dp_replicate: int, dp_shard: int, cp: int, tp: int, pp: int
) -> list[int]:
    """Expert-parallel degrees the validator accepts for this layout (1 always)."""
    flavor = flavor_args(cfg)
    if moe_of(flavor) is None:
        return [1]
    out = [1]
    for ep in divisors(dp_shard * cp)[1:]:  # EP borrows from dp_shard x cp
        trial = copy.copy(cfg)
        trial.parallelism = dataclasses.replace(
            cfg.parallelism,
            data_parallel_replicate_degree=dp_replicate,
            data_parallel_shard_degree=dp_shard,
            context_parallel_degree=cp,
            tensor_parallel_degree=tp,
            pipeline_parallel_degree=pp,
            expert_parallel_degree=ep,
        )
        dims = ParallelDims(dp_replicate, dp_shard, cp, tp, pp, world_size, ep=ep)
        try:
            validate_expert_parallel(trial, dims)
        except ConfigError:
            continue
        out.append(ep)
    return out


def moe_step_terms(
    a: Any,
    layout: Any,
    hw: Any,
    seq_len: int,
    act: int,
    peak_flops: float,
    recompute_fraction: float,
) -> dict[str, float]:
    """Seconds per step of ``all_to_all`` (and its bytes per rank, ``all_to_all_bytes``) and
    of ``moe_tp`` (expert compute repeated on every TP rank); zeros for a dense model."""
    moe = moe_of(a)
    out = {"all_to_all": 0.0, "all_to_all_bytes": 0.0, "moe_tp": 0.0}
    if moe is None:
        return out
    dp = layout.dp_replicate * layout.dp_shard
    tokens_group = layout.global_batch_size * seq_len / dp / layout.cp  # a TP group's tokens
    layers_here = a.n_moe_layers / layout.pp
    passes = 4 + 2 * recompute_fraction  # dispatch + combine, fwd + bwd (+ recomputed fwd)
    if layout.ep > 1:
        one = all_to_all_bytes(a, tokens_group, act, layout.ep)
        spans = layout.ep * layout.cp * layout.tp > hw.gpus_per_node
        bw = (hw.inter_node_gbps if spans else hw.intra_node_gbps) * 1e9
        latency = (hw.inter_latency_us if spans else hw.intra_latency_us) * 1e-6
        calls = layers_here * passes * layout.accumulation * max(1, layout.microbatches)
        out["all_to_all_bytes"] = layers_here * passes * one
        out["all_to_all"] = out["all_to_all_bytes"] / bw + calls * (layout.ep - 1) * latency
    if layout.tp > 1:
        routed = (moe.top_k + moe.num_shared_experts) * 3 * a.dim * moe.expert_dim
        ffn_flops = (6 + 2 * recompute_fraction) * routed  # fwd + bwd (+ recomputed fwd)
        # The base compute term divides these by tp; every TP rank runs all of its group's.
        extra = tokens_group * layers_here * ffn_flops * (1 - 1 / layout.tp)
        out["moe_tp"] = extra / peak_flops
    return out
