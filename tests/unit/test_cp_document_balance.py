"""Context parallel with packed documents: the load balancers, their cost, the block-causal
all-gather core under a per-sample token permutation (docs/context_parallel.md)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.launcher import run_ranks
from tests.parity import DEBUG_TOML
from torchtitan.config import ConfigError, parse_args
from torchtitan.distributed.context_parallel import core as cpmod
from torchtitan.distributed.context_parallel import load_balanced_positions
from torchtitan.distributed.context_parallel.layout import (
    doc_ids_from_lengths,
    imbalance,
    rank_costs,
    shard_index,
    take_tokens,
)
from torchtitan.distributed.context_parallel.ring import RingDocumentAttention
from torchtitan.models.common.attention import AttentionMask
from torchtitan.preflight.validate import validate_config

LENGTHS = [5, 30, 3, 17, 60, 9, 40, 2, 21, 13, 44, 8, 70, 11, 26]  # packed over seq 96


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_every_balancer_is_a_partition_of_equal_shares(cp: int) -> None:
    seq = 2 * cp * 8
    ids = doc_ids_from_lengths(LENGTHS * 4, seq)
    for balancer in ("headtail", "document"):
        idx = [shard_index(seq, cp, r, balancer, ids) for r in range(cp)]
        full = torch.cat([i.expand(ids.shape[0], -1) for i in idx], dim=1)
        assert torch.equal(full.sort(dim=1).values, torch.arange(seq).expand_as(full))
    assert torch.equal(shard_index(seq, cp, 1, "headtail"), load_balanced_positions(seq, cp, 1))
    # One document filling the window: the document order is the sequence, so both agree.
    one = torch.zeros(1, seq, dtype=torch.int32)
    for r in range(cp):
        assert torch.equal(
            shard_index(seq, cp, r, "document", one)[0], shard_index(seq, cp, r, "headtail")
        )


@pytest.mark.parametrize("cp", [2, 4])
def test_document_balancer_evens_out_block_causal_work(cp: int) -> None:
    """max/mean attention pairs per rank: headtail is uneven with mixed lengths, the
    per-document split is within 2% (exactly even when lengths divide by 2 x cp)."""
    ids = doc_ids_from_lengths([40, 200, 8, 600, 24, 96, 300, 16] * 16, 512)
    head, doc = (imbalance(rank_costs(ids, cp, b)) for b in ("headtail", "document"))
    assert head > 1.02 and doc < 1.02 and doc < head, (head, doc)
    even = torch.tensor([[0] * 64 + [1] * 32 + [2] * 160])
    assert imbalance(rank_costs(even, cp, "document")) == 1.0
    total = sum(n * (n + 1) // 2 for n in (64, 32, 160))
    assert rank_costs(even, cp, "document").sum() == total == rank_costs(even, cp, "headtail").sum()


def test_take_tokens_keeps_every_tensor_together() -> None:
    ids = doc_ids_from_lengths(LENGTHS, 48)
    tokens = torch.arange(48).expand(ids.shape[0], 48) * 10
    hidden = tokens[..., None].expand(-1, -1, 3).float()
    idx = shard_index(48, 2, 1, "document", ids)
    assert torch.equal(take_tokens(tokens, idx), idx * 10)
    assert torch.equal(take_tokens(hidden, idx)[..., 2], (idx * 10).float())


def test_block_skips_other_documents_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """A query block inside one document attends over that document's keys only, and its
    output equals the dense-mask SDPA over all keys."""
    g = torch.Generator().manual_seed(0)
    seq, ids = 32, torch.tensor([[0] * 10 + [1] * 14 + [2] * 8])
    q, k, v = (torch.randn(1, 2, seq, 4, generator=g) for _ in range(3))
    pos = torch.arange(seq)[None]
    dense = AttentionMask(ids).dense()
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    widths: list[int] = []
    sdpa = F.scaled_dot_product_attention

    def spy(q: torch.Tensor, k: torch.Tensor, *a: Any, **kw: Any) -> torch.Tensor:
        widths.append(k.shape[2])
        return sdpa(q, k, *a, **kw)

    monkeypatch.setattr(cpmod.F, "scaled_dot_product_attention", spy)
    blk = slice(12, 20)  # inside document 1 (positions 10..23)
    out = cpmod._document_block(q[:, :, blk], k, v, pos[:, blk], ids[:, blk], pos, ids)
    torch.testing.assert_close(out, ref[:, :, blk], rtol=1e-6, atol=1e-6)
    assert widths == [10]  # keys 10..19, not 32


def _doc_attention_rank(method: str, balancer: str, block: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    cp, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    torch.distributed.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    q, k, v, grad_out, ids = _doc_inputs(short=(method, balancer) == ("ring", "headtail"))
    idx = shard_index(ids.shape[1], cp, rank, balancer, ids)
    local = [take_tokens(t.transpose(1, 2), idx).transpose(1, 2).detach() for t in (q, k, v)]
    for t in local:
        t.requires_grad_()
    pos = idx.expand(ids.shape[0], -1) if idx.dim() == 1 else idx
    mask = AttentionMask(take_tokens(ids, idx), positions=pos)
    if method == "ring":
        core: torch.nn.Module = RingDocumentAttention(mesh, 1)
    else:
        core = cpmod.AllGatherKVAttention(mesh, 1, query_block=block)
    out = core(*local, mask)
    out.backward(take_tokens(grad_out.transpose(1, 2), idx).transpose(1, 2))
    return {
        "skipped": getattr(core, "steps_skipped", 0),
        "idx": pos.numpy(),
        "out": out.detach().numpy(),
        "grads": [t.grad.numpy() for t in local],
    }


def _doc_inputs(short: bool = False) -> tuple[torch.Tensor, ...]:
    """Two windows of 48 tokens: documents crossing every shard boundary, or (``short``)
    documents of at most 4 tokens, so some ring steps have nothing to attend to."""
    g = torch.Generator().manual_seed(0)
    ids = doc_ids_from_lengths([2, 3, 1, 4] * 12 if short else LENGTHS, 48)[:2]
    q, k, v, grad = (torch.randn(2, 2, 48, 8, generator=g) for _ in range(4))
    return q, k, v, grad, ids


@pytest.mark.parametrize(
    "method, cp, balancer, block",
    [
        ("allgather", 2, "document", 5),
        ("ring", 2, "document", 0),
        pytest.param("allgather", 3, "headtail", 3, marks=pytest.mark.slow),
        pytest.param("ring", 4, "headtail", 0, marks=pytest.mark.slow),
        pytest.param("ring", 3, "document", 0, marks=pytest.mark.slow),
    ],
)
def test_block_causal_core_equals_one_process(
    method: str, cp: int, balancer: str, block: int
) -> None:
    """Under a per-sample permutation of the tokens (all-gather: with query blocks that skip
    keys; ring: K/V shards passed around, steps without an allowed pair skipped), outputs and
    q/k/v gradients equal the matching tokens of one process's block-causal SDPA."""
    q, k, v, grad_out, ids = _doc_inputs(short=(method, balancer) == ("ring", "headtail"))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*full, attn_mask=AttentionMask(ids).dense())
    out.backward(grad_out)
    results = run_ranks(_doc_attention_rank, cp, method, balancer, block, timeout=120)
    if (method, balancer) == ("ring", "headtail"):  # rank 0's head sees no later shard
        assert sum(r["skipped"] for r in results) > 0
    for r in results:
        idx = torch.from_numpy(r["idx"])
        for name, ref, got in [
            ("out", out.detach(), r["out"]),
            *[(f"grad {n}", t.grad, r["grads"][i]) for i, (n, t) in enumerate(zip("qkv", full))],
        ]:
            want = take_tokens(ref.transpose(1, 2), idx).transpose(1, 2)
            torch.testing.assert_close(torch.from_numpy(got), want, rtol=1e-5, atol=1e-6, msg=name)


def _cfg(*argv: str) -> Any:
    return parse_args(["--job.config_file", DEBUG_TOML, *argv])


def test_document_balancer_needs_block_causal() -> None:
    cfg = _cfg("--parallelism.context_parallel_load_balancer", "document")
    with pytest.raises(ConfigError) as e:
        validate_config(cfg, world_size=1)
    assert e.value.field == "parallelism.context_parallel_load_balancer"
    assert "block_causal" in e.value.fix


def test_unknown_balancer_is_one_line_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    from torchtitan.config.__main__ import main

    assert (
        main(
            [
                "--job.config_file",
                DEBUG_TOML,
                "--parallelism.context_parallel_load_balancer",
                "zigzag",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "context_parallel_load_balancer = 'zigzag'" in err[0], err


def test_seq_len_not_split_into_2cp_chunks_is_one_line_exit_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A CP degree whose 2 x cp does not divide seq_len, from the entry point: one line naming
    the field, the rule and a length that works."""
    from torchtitan.config.__main__ import main

    argv = ["--job.config_file", DEBUG_TOML, "--world_size", "4"]
    argv += ["--parallelism.context_parallel_degree", "4", "--training.seq_len", "100"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "training.seq_len" in err[0] and "2 x cp = 8" in err[0], err
    assert "e.g. 96" in err[0]


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--lengths", "300,9000", "--seq_lens", "8192"], "a document of 9000 tokens"),
        (["--lengths", "300,x"], "not comma-separated integers"),
        (["--seq_lens", "1000", "--cps", "8"], "not divisible by 2 x cp = 16"),
    ],
)
def test_cp_documents_benchmark_bad_input_is_one_line_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: list, words: str
) -> None:
    """benchmarks/cp_documents.py: documents longer than the sequence, lengths that are not
    integers, a seq_len that 2 x cp does not divide."""
    from tests.script_loader import load

    bench = load("benchmarks/cp_documents.py", "cp_documents_bench")
    monkeypatch.setattr("sys.argv", ["cp_documents.py", "--no-time", *argv])
    with pytest.raises(SystemExit) as e:
        bench.main()
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
