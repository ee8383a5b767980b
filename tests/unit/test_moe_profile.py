"""benchmarks/moe_profile.py: one profiled MoE step split into buckets whose shares add up to
100%, each MoE piece found (docs/performance.md, "Where an MoE step's time goes")."""

from __future__ import annotations

import json

import pytest

from tests.script_loader import load


def test_bucket_rules() -> None:
    mp = load("benchmarks/moe_profile.py")
    assert mp.bucket(["L:routing"], "topk") == "top-k"
    assert mp.bucket(["L:routing"], "mm") == "dense GEMMs"
    assert mp.bucket(["L:dispatch", "L:experts"], "_grouped_mm") == "expert GEMMs"
    assert mp.bucket(["L:dispatch"], "argsort") == "permutation"
    assert mp.bucket(["L:dispatch"], "index_add_") == "un-permutation"
    assert mp.bucket(["L:experts", "L:padding"], "index_copy") == "padding copies"
    assert mp.bucket([], "mm") == "dense GEMMs" and mp.bucket([], "embedding") == "other"


@pytest.mark.parametrize("float8", [False, True])
def test_one_step_split(float8: bool, capsys: pytest.CaptureFixture[str]) -> None:
    mp = load("benchmarks/moe_profile.py")
    argv = ["--seq_len", "32", "--threads", "1"] + (["--float8_experts"] if float8 else [])
    assert mp.main(argv) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    share, secs = row["share_pct"], row["seconds"]
    assert abs(sum(share.values()) - 100) < 0.5, share
    # every bucket timed (its seconds, not its share: a small one rounds to 0.0% on a loaded box)
    for b in ("expert GEMMs", "dense GEMMs", "attention", "top-k", "permutation", "combine"):
        assert secs.get(b, 0) > 0, (b, secs)
    assert ("padding copies" in share) == float8
