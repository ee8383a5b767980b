"""Tier 4 (docs/architecture.md, section 1, promise 2): run_train.sh with pipeline parallel on 2 CPU ranks, output of both shown.

Only the last stage computes a loss. Every rank that logs must still print the real loss, the
same on all ranks at each log step, finite, and never a placeholder such as -1. ``LOG_RANK`` is
given as ``0,last``: a comma list with the word ``last``, which must resolve to rank 1 here.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from tests.launcher import run_train_sh
from tests.parity import PP2_1F1B

LINE = re.compile(
    r"\[rank (\d+) pp=(\d+) stages=([\d,]+)(\(last\))?\] step\s+(\d+)\s+loss\s+(\S+) \(avg\s+(\S+)\)"
)


def test_pp_run_train_every_rank_logs_the_real_loss(tmp_path: Path) -> None:
    args = ["--training.steps", "6", "--training.seq_len", "64", "--metrics.log_freq", "2"]
    args += ["--metrics.no-enable_tensorboard", *PP2_1F1B]
    out = run_train_sh(tmp_path, *args, log_rank="0,last")

    by_rank: dict[int, dict[int, tuple[str, str]]] = {0: {}, 1: {}}
    for m in LINE.finditer(out):
        rank, pp_rank, stages, last = int(m[1]), int(m[2]), m[3], bool(m[4])
        # Rank 0 holds stage 0, rank 1 the last stage (stage 1), and the prefix says so.
        assert (pp_rank, stages, last) == ((0, "0", False) if rank == 0 else (1, "1", True))
        by_rank[rank][int(m[5])] = (m[6], m[7])
    assert list(by_rank[0]) == [1, 2, 4, 6], out[-4000:]
    assert by_rank[0] == by_rank[1], f"ranks logged different losses: {by_rank}"
    for loss, avg in by_rank[0].values():
        assert math.isfinite(float(loss)) and math.isfinite(float(avg))
        assert float(loss) > 0 and float(avg) > 0
    assert not re.search(r"loss\s+-1", out), "a placeholder loss reached the log"
    assert float(by_rank[0][6][0]) < float(by_rank[0][1][0]), "the loss did not fall"
