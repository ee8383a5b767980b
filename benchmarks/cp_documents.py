"""Context parallel with packed documents: attention work and time per cp rank, per balancer.

    python benchmarks/cp_documents.py                     # cost table + timed attention
    python benchmarks/cp_documents.py --no-time           # cost table only (seconds)
    python benchmarks/cp_documents.py --lengths 300,5000,80 --seq_lens 8192

Two length distributions are packed into windows the way the data loader packs them
(``layout.doc_ids_from_lengths``): the test corpus (``tests/assets/test_corpus``, each
document tokenized with the test tokenizer, plus BOS and EOS) and a long-tail synthetic one
(Pareto, shape 1.1, scale 128 tokens, capped at 64k; seed 0). ``--lengths`` replaces both.

* cost: block-causal (query, key) pairs per cp rank (``layout.rank_costs``, what attention
  FLOPs are proportional to), ``max / mean`` over the ranks, averaged over the windows (one
  window per step and rank: the slowest rank sets the step) and for the worst window.
* time: forward + backward of the block-causal all-gather core's attention for each rank's
  queries (``context_parallel.core.document_attention``, the code the ranks run, here one
  rank after another in one process so the ranks do not share cores), ``--heads`` heads of 64
  (default 4), fp32, one window (``--time_dists`` chooses the distributions);
  ``max / mean`` of the per-rank times. ``--kernels sdpa_fwd,flex_fwd`` times the forward
  alone, of that path and of FlexAttention over the CP block mask (``context_parallel/flex.py``,
  compiled before timing; torch's CPU flex has no backward).

Bad input (one line, exit 2): a length above the sequence, a seq_len not divisible by 2 x cp,
an unknown kernel.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from torchtitan.distributed.context_parallel.core import document_attention
from torchtitan.distributed.context_parallel.flex import flex_document_attention
from torchtitan.distributed.context_parallel.layout import (
    BALANCERS,
    doc_ids_from_lengths,
    positions_in_documents,
    rank_costs,
    shard_index,
    take_tokens,
    window_imbalance,
)

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ("sdpa", "sdpa_fwd", "flex_fwd")


def corpus_lengths() -> list[int]:
    from torchtitan.data.tokenizer import build_tokenizer

    tok = build_tokenizer(ROOT / "tests/assets/tokenizer")
    lines = (ROOT / "tests/assets/test_corpus/train.jsonl").read_text().splitlines()
    return [len(tok.encode(json.loads(line)["text"])) + 2 for line in lines]


def long_tail_lengths(n: int = 20000) -> list[int]:
    g = torch.Generator().manual_seed(0)
    u = torch.rand(n, generator=g, dtype=torch.float64)
    return (128 / u ** (1 / 1.1)).clamp(max=65536).long().tolist()


def cost_rows(name: str, lengths: list[int], seq: int, cps: list[int]) -> list[dict]:
    rows = []
    for cp in cps:
        row: dict = {"dist": name, "seq_len": seq, "cp": cp}
        for b in BALANCERS:
            ratio = window_imbalance(lengths, seq, cp, b)  # the planner's cost too
            row["windows"] = ratio.shape[0]
            row[f"{b}_mean"], row[f"{b}_worst"] = (
                round(float(ratio.mean()), 4),
                round(float(ratio.max()), 4),
            )
        rows.append(row)
    return rows


def time_rank(
    ids: torch.Tensor, cp: int, rank: int, balancer: str, heads: int = 4, kernel: str = "sdpa"
) -> float:
    """Seconds of one rank's attention: forward + backward of the SDPA query blocks, or (the
    ``*_fwd`` kernels) the forward alone, of the SDPA path or of FlexAttention over the CP
    block mask (``context_parallel/flex.py``; compiled first, untimed)."""
    seq = ids.shape[1]
    g = torch.Generator().manual_seed(0)
    grad = kernel == "sdpa"
    q, k, v = (torch.randn(1, heads, seq, 64, generator=g, requires_grad=grad) for _ in range(3))
    idx = shard_index(seq, cp, rank, balancer, ids).expand(1, -1)
    pos = torch.arange(seq)[None]
    q_loc = take_tokens(q.detach().transpose(1, 2), idx).transpose(1, 2).requires_grad_(grad)
    where = (idx, take_tokens(ids, idx), pos, ids)
    if kernel == "flex_fwd":
        with torch.no_grad():  # compile (once per shape; a grad-mode change would recompile)
            flex_document_attention(q_loc, k, v, where)
    t0 = time.perf_counter()
    if grad:
        document_attention(q_loc, k, v, where).sum().backward()
    with torch.no_grad():
        if kernel == "flex_fwd":
            flex_document_attention(q_loc, k, v, where)
        elif kernel == "sdpa_fwd":
            document_attention(q_loc, k, v, where)
    return time.perf_counter() - t0


def bad(msg: str) -> None:
    print(f"benchmark error: {msg}", file=sys.stderr)
    sys.exit(2)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seq_lens", default="32768,65536,131072")
    p.add_argument("--cps", default="2,4,8")
    p.add_argument("--time_seq_lens", default="32768")
    p.add_argument("--time_cps", default="2,4")
    p.add_argument("--lengths", default="", help="comma-separated document lengths")
    p.add_argument("--no-time", dest="time", action="store_false")
    p.add_argument("--heads", type=int, default=4, help="heads of 64 in the timed attention")
    p.add_argument("--time_dists", default="corpus,long_tail", help="distributions to time")
    p.add_argument(
        "--kernels",
        default="sdpa",
        help="timed: sdpa (forward + backward), sdpa_fwd, flex_fwd (CPU flex has no backward)",
    )
    a = p.parse_args()
    kernels = a.kernels.split(",")
    if unknown := set(kernels) - set(KERNELS):
        bad(f"--kernels {a.kernels}: {sorted(unknown)} unknown; use some of {','.join(KERNELS)}")
    seqs, cps = [int(x) for x in a.seq_lens.split(",")], [int(x) for x in a.cps.split(",")]
    for s in seqs + [int(x) for x in a.time_seq_lens.split(",")]:
        for cp in cps + [int(x) for x in a.time_cps.split(",")]:
            if s % (2 * cp):
                bad(
                    f"--seq_lens {s}: not divisible by 2 x cp = {2 * cp}; use a multiple of {2 * cp}"
                )
    if a.lengths:
        try:
            given = [int(x) for x in a.lengths.split(",")]
        except ValueError:
            bad(f"--lengths {a.lengths!r}: not comma-separated integers; use e.g. 300,5000,80")
        for n in given:
            if n > min(seqs) or n < 1:
                bad(
                    f"--lengths: a document of {n} tokens does not fit one window of {min(seqs)} (1..seq_len)"
                )
        dists = {"given": given}
    else:
        dists = {"corpus": corpus_lengths(), "long_tail": long_tail_lengths()}
    for name, lengths in dists.items():
        for seq in seqs:
            for row in cost_rows(name, lengths, seq, cps):
                print(json.dumps(row), flush=True)
    if not a.time:
        return
    torch.set_num_threads(1)
    timed = {n: d for n, d in dists.items() if n in a.time_dists.split(",") or n == "given"}
    for name, lengths in timed.items():
        for seq in [int(x) for x in a.time_seq_lens.split(",")]:
            ids = doc_ids_from_lengths(lengths * (2 * seq // sum(lengths) + 2), seq)[1:2]
            pairs = float((positions_in_documents(ids) + 1).sum())
            for cp in [int(x) for x in a.time_cps.split(",")]:
                row: dict = {"dist": name, "seq_len": seq, "cp": cp, "pairs": pairs}
                row["heads"] = a.heads
                for b in BALANCERS:
                    for kernel in kernels:
                        ts = [time_rank(ids, cp, r, b, a.heads, kernel) for r in range(cp)]
                        name_k = b if kernel == "sdpa" else f"{b}_{kernel}"
                        row[f"{name_k}_s"] = [round(t, 3) for t in ts]
                        row[f"{name_k}_max_over_mean"] = round(max(ts) / (sum(ts) / cp), 3)
                    row[f"{b}_cost_max_over_mean"] = round(
                        float(rank_costs(ids, cp, b).max() / rank_costs(ids, cp, b).mean()), 4
                    )
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
