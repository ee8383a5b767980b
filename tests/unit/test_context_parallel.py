"""Context parallel pieces: the load-balanced layout, the all-gather attention, the config rules."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.launcher import run_ranks
from tests.parity import DEBUG_TOML
from torchtitan.config import ConfigError, parse_args
from torchtitan.distributed.context_parallel import (
    chunk_order,
    load_balanced_positions,
    shard_sequence,
    unshard_sequence,
)
from torchtitan.preflight.validate import validate_config


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_shard_unshard_round_trip_and_positions(cp: int) -> None:
    seq = 2 * cp * 5
    x = torch.arange(3 * seq).view(3, seq)
    shards = [shard_sequence(x, cp, r) for r in range(cp)]
    assert all(s.shape == (3, seq // cp) for s in shards)
    assert torch.equal(unshard_sequence(shards), x)
    for r, s in enumerate(shards):
        # Row 0 of x is arange(seq): a rank's tokens are exactly its positions.
        assert torch.equal(s[0], load_balanced_positions(seq, cp, r))
    # Rank 0 holds the first and the last chunk.
    c = seq // (2 * cp)
    assert torch.equal(shards[0][0], torch.cat([torch.arange(c), torch.arange(seq - c, seq)]))
    assert sorted(chunk_order(cp)) == list(range(2 * cp))


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_each_rank_does_the_same_causal_work(cp: int) -> None:
    """(query, key) pairs that causal attention computes, per rank: equal with head-tail
    balancing; a plain contiguous split would give the last rank 2 x cp - 1 times the first's."""
    seq = 2 * cp * 16
    k_pos = torch.arange(seq)

    def work(q_pos: torch.Tensor) -> int:
        return int((k_pos[None, :] <= q_pos[:, None]).sum())

    balanced = [work(load_balanced_positions(seq, cp, r)) for r in range(cp)]
    assert len(set(balanced)) == 1, balanced
    assert sum(balanced) == seq * (seq + 1) // 2
    plain = [work(torch.arange(seq)[r * seq // cp : (r + 1) * seq // cp]) for r in range(cp)]
    assert plain[-1] / plain[0] > 2 * cp - 2


def _attention_rank(n_rep: int) -> dict[str, Any]:
    """Each rank: attention on its shard; returns output and input gradients (local)."""
    import os

    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan.distributed.context_parallel import AllGatherKVAttention

    cp, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    # gloo explicitly: left to itself, torch would add NCCL where CUDA is visible.
    torch.distributed.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    q, k, v, grad_out = _inputs(n_rep)
    local = [shard_sequence(t, cp, rank, dim=2).detach().requires_grad_() for t in (q, k, v)]
    # The model repeats K/V heads for GQA before the core; the core gathers the distinct ones.
    k_rep = local[1].repeat_interleave(n_rep, dim=1)
    v_rep = local[2].repeat_interleave(n_rep, dim=1)
    out = AllGatherKVAttention(mesh, n_rep)(local[0], k_rep, v_rep)
    out.backward(shard_sequence(grad_out, cp, rank, dim=2))
    # numpy arrays pickle by value (tensors would go through shared memory the rank frees).
    return {"out": out.detach().numpy(), "grads": [t.grad.numpy() for t in local]}


def _inputs(n_rep: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    b, h_kv, s, d = 2, 2, 24, 8
    q = torch.randn(b, h_kv * n_rep, s, d, generator=g)
    k, v = (torch.randn(b, h_kv, s, d, generator=g) for _ in range(2))
    return q, k, v, torch.randn(b, h_kv * n_rep, s, d, generator=g)


@pytest.mark.smoke
@pytest.mark.parametrize("cp, n_rep", [(2, 1), (3, 2)])
def test_all_gather_attention_equals_full_causal_attention(cp: int, n_rep: int) -> None:
    """Outputs and the gradients of q, k, v (k/v through the gather's reduce-scatter) equal the
    matching shards of one process's causal SDPA."""
    q, k, v, grad_out = _inputs(n_rep)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(
        full[0],
        full[1].repeat_interleave(n_rep, dim=1),
        full[2].repeat_interleave(n_rep, dim=1),
        is_causal=True,
    )
    out.backward(grad_out)
    results = run_ranks(_attention_rank, cp, n_rep, timeout=120)
    for name, ref, got in [
        ("out", out.detach(), [torch.from_numpy(r["out"]) for r in results]),
        *[
            (f"grad {n}", t.grad, [torch.from_numpy(r["grads"][i]) for r in results])
            for i, (n, t) in enumerate(zip("qkv", full))
        ],
    ]:
        torch.testing.assert_close(
            unshard_sequence(got, dim=2),
            ref,
            rtol=1e-5,
            atol=1e-6,
            msg=lambda m, name=name: f"{name}: {m}",
        )


def _cfg(*argv: str) -> Any:
    return parse_args(["--job.config_file", DEBUG_TOML, *argv])


def test_sequence_length_must_split_into_2cp_chunks() -> None:
    cfg = _cfg("--parallelism.context_parallel_degree", "4", "--training.seq_len", "100")
    with pytest.raises(ConfigError) as e:
        validate_config(cfg, world_size=4)
    assert e.value.field == "training.seq_len" and "2 x cp = 8" in str(e.value)
    assert "e.g. 96" in str(e.value)
    # With TP, each rank's share must also split over tp for sequence parallel.
    cfg = _cfg(
        "--parallelism.context_parallel_degree",
        "2",
        "--training.seq_len",
        "68",
        "--parallelism.tensor_parallel_degree",
        "4",
    )
    with pytest.raises(ConfigError, match="cp x tp = 8"):
        validate_config(cfg, world_size=8)
    validate_config(_cfg("--parallelism.context_parallel_degree", "4"), world_size=4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU rule")
def test_ring_attention_is_cuda_only() -> None:
    cfg = _cfg(
        "--parallelism.context_parallel_degree",
        "2",
        "--parallelism.context_parallel_method",
        "ring",
    )
    with pytest.raises(ConfigError) as e:
        validate_config(cfg, world_size=2)
    assert e.value.field == "parallelism.context_parallel_method"
    assert "needs CUDA" in str(e.value) and "allgather" in e.value.fix


def test_rotate_method_needs_ring_attention() -> None:
    cfg = _cfg(
        "--parallelism.context_parallel_degree", "2",
        "--parallelism.context_parallel_rotate_method", "alltoall",
    )  # fmt: skip
    with pytest.raises(ConfigError) as e:
        validate_config(cfg, world_size=2)
    assert e.value.field == "parallelism.context_parallel_rotate_method"


def test_model_without_context_parallel_support_is_rejected() -> None:
    import tests.toy_model  # noqa: F401  (registers "toy", whose plan has no CP)

    cfg = _cfg("--model.name", "toy", "--model.flavor", "tiny")
    cfg.parallelism.context_parallel_degree = 2
    with pytest.raises(ConfigError, match="does not support context parallel"):
        validate_config(cfg, world_size=2)


def _ring_batch_rank() -> dict[str, Any]:
    """The ring method's batch context on CPU: torch shards inputs, labels and the RoPE table
    in place; the layout must be ours, or RoPE positions would not match the tokens."""
    import os

    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan.distributed.context_parallel import ContextParallel

    cp, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    # gloo explicitly: left to itself, torch would add NCCL where CUDA is visible.
    torch.distributed.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    part = nn.Module()
    table = torch.arange(16 * 3, dtype=torch.float32).view(16, 3)
    part.register_buffer("freqs_cis", table.clone())
    inputs, labels = torch.arange(32).view(2, 16), torch.arange(32).view(2, 16) + 100
    out: dict[str, Any] = {}
    cp_ring = ContextParallel(mesh, "ring", [part], rope_buffer="freqs_cis")
    with cp_ring.batch(inputs, labels) as (i, lab, _):
        out["inputs_ok"] = torch.equal(i, shard_sequence(torch.arange(32).view(2, 16), cp, rank))
        out["labels_ok"] = torch.equal(
            lab, shard_sequence(torch.arange(32).view(2, 16) + 100, cp, rank)
        )
        out["table_ok"] = torch.equal(part.freqs_cis, shard_sequence(table, cp, rank, dim=0))
    out["table_restored"] = torch.equal(part.freqs_cis, table)
    return out


def test_ring_method_shards_like_allgather() -> None:
    for r in run_ranks(_ring_batch_rank, 2, timeout=120):
        assert r == {"inputs_ok": True, "labels_ok": True, "table_ok": True, "table_restored": True}
