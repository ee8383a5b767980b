"""Replica fault tolerance's pure parts (docs/fault_tolerance.md): each replica group's share of
the data, and the data position a recovering group takes from its peer."""

from __future__ import annotations

import itertools

import torch

from torchtitan.config.sections import FaultTolerance
from torchtitan.data.dataloader import build_dataloader
from torchtitan.data.tokenizer import build_tokenizer
from torchtitan.fault_tolerance.replica import data_position, data_shard, load_data_position


def test_each_group_reads_its_own_share() -> None:
    off = FaultTolerance()
    assert data_shard(off, 1, 2) == (1, 2)  # fault tolerance off: unchanged
    ft = FaultTolerance(enable=True, replica_id=2, group_size=3)
    shards = {
        data_shard(FaultTolerance(enable=True, replica_id=g, group_size=3), r, 2)
        for g in range(3)
        for r in range(2)
    }
    assert shards == {(i, 6) for i in range(6)}  # every (group, rank) a distinct shard
    assert data_shard(ft, 1, 2) == (5, 6)


def _loader(group: int):  # noqa: ANN202
    tok = build_tokenizer("tests/assets/tokenizer")
    return build_dataloader("test_corpus", None, tok, 32, 2, group, 2, split="train")


def test_peer_position_is_the_recovering_groups_own() -> None:
    """A group that restarts takes group 0's data position after 5 steps; it must then draw
    exactly the batches its own shard would have given at step 6, 7, 8 (window sharding)."""
    peer = _loader(0)
    peer_batches = iter(peer)
    for _ in range(5):
        next(peer_batches)
    position = data_position(peer)

    uninterrupted = _loader(1)  # what group 1 would have drawn without the failure
    expected = list(itertools.islice(iter(uninterrupted), 8))[5:]

    restarted = _loader(1)
    load_data_position(restarted, position)
    got = list(itertools.islice(iter(restarted), 3))
    for (x, y), (ex, ey) in zip(got, expected, strict=True):
        assert torch.equal(x, ex) and torch.equal(y, ey)
    # and it is not the peer's data
    assert not torch.equal(got[0][0], next(peer_batches)[0])


def test_explain_names_the_layout_traffic_and_memory() -> None:
    """--job.explain with fault tolerance: the group, the cross-group bytes of a rank's
    gradient shard (debugmodel's fp32 parameters over FSDP 2), the recovery buffer."""
    from torchft.coordination import LighthouseServer

    from torchtitan.fault_tolerance.explain import MIB
    from torchtitan.models import MODELS
    from torchtitan.planner.auto import load_config
    from torchtitan.planner.explain import explain

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1)
    try:
        argv = ["--job.config_file", "train_configs/debug_model.toml", "--fault_tolerance.enable"]
        argv += ["--fault_tolerance.group_size", "3", "--fault_tolerance.replica_id", "1"]
        argv += ["--fault_tolerance.lighthouse", lighthouse.address()]
        cfg, _, _ = load_config(argv, world_size=2)
    finally:
        lighthouse.shutdown()
    text = explain(cfg, 2, device_type="cpu")
    shard = MODELS["llama3"].num_params(MODELS["llama3"].flavors["debugmodel"]) * 4 / 2 / MIB
    assert "this job is replica group 1 of 3" in text and "(6 data shards" in text, text
    assert f"all-reduces its {shard:,.1f} MiB gradient shard" in text, text
    assert f"~{2 * 2 / 3 * shard:,.1f} MiB sent per step" in text, text
    assert f"recovery buffer {3 * shard:,.1f} MiB (host)" in text, text


def test_modes_and_datasets_it_does_not_shard_are_refused() -> None:
    """The replica group wraps the language-model step and the text loaders' sharding: a
    post-training mode or a record dataset (chat, vlm) with it is one ConfigError, never a run
    whose groups read the same data or skip the cross-group reduction."""
    import pytest

    from torchtitan.config.errors import ConfigError
    from torchtitan.config.job_config import JobConfig
    from torchtitan.preflight.validate_resilience import validate_fault_tolerance

    def cfg(**training: str) -> JobConfig:
        c = JobConfig()
        c.fault_tolerance.enable, c.fault_tolerance.group_size = True, 2
        for k, v in training.items():
            setattr(c.training, k, v)
        return c

    with pytest.raises(ConfigError, match="training.mode"):
        validate_fault_tolerance(cfg(mode="dpo"))
    for dataset in ("chat", "vlm"):
        with pytest.raises(ConfigError, match=f"training.dataset = {dataset!r}|{dataset}"):
            validate_fault_tolerance(cfg(dataset=dataset))


def test_missing_torchft_is_one_config_error(monkeypatch) -> None:  # noqa: ANN001
    """Without torchft installed (the GPU image's torch 2.11 venv has none) the run is refused
    before any process group, naming the package and the extra."""
    import importlib.util

    import pytest

    from torchtitan.config.errors import ConfigError
    from torchtitan.config.job_config import JobConfig
    from torchtitan.preflight.validate_resilience import validate_fault_tolerance

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else real(name, *a)
    )
    cfg = JobConfig()
    cfg.fault_tolerance.enable, cfg.fault_tolerance.group_size = True, 2
    with pytest.raises(ConfigError, match="torchft"):
        validate_fault_tolerance(cfg)
