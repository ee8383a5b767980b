"""Semi-synchronous replica groups' pure parts (docs/fault_tolerance.md): the preflight's
refusals, ``--job.explain``'s traffic and outer-state lines, and the planner's per-rank memory
with the recovery buffer and DiLoCo's outer state."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig
from torchtitan.config.manager import parse_args
from torchtitan.preflight.validate_resilience import validate_fault_tolerance

DEBUG = ["--job.config_file", "train_configs/debug_model.toml"]
FT = ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2"]


def _cfg(*argv: str) -> JobConfig:
    return parse_args([*DEBUG, *argv])


@pytest.mark.parametrize(
    ("argv", "field", "words"),
    [
        ([*FT, "--fault_tolerance.semi_sync", "diloco", "--fault_tolerance.sync_every", "0"],
         "fault_tolerance.sync_every = 0", "must be an integer >= 1"),
        ([*FT, "--fault_tolerance.semi_sync", "diloco", "--fault_tolerance.sync_every", "-3"],
         "fault_tolerance.sync_every = -3", "must be an integer >= 1"),
        (["--fault_tolerance.semi_sync", "local_sgd"],
         "fault_tolerance.semi_sync = 'local_sgd'", "need fault_tolerance.enable"),
        ([*FT, "--fault_tolerance.semi_sync", "local_sgd", "--fault_tolerance.outer_lr", "0.7"],
         "fault_tolerance.outer_lr = 0.7", "only with semi_sync diloco"),
        ([*FT, "--fault_tolerance.outer_momentum", "0.9"],
         "fault_tolerance.outer_momentum = 0.9", "only with semi_sync diloco"),
        ([*FT, "--fault_tolerance.sync_every", "4"],
         "fault_tolerance.sync_every = 4", "only semi_sync local_sgd or diloco"),
        ([*FT, "--fault_tolerance.semi_sync", "diloco", "--fault_tolerance.outer_momentum", "1"],
         "fault_tolerance.outer_momentum = 1.0", "must be in [0, 1)"),
        ([*FT, "--fault_tolerance.semi_sync", "diloco", "--fault_tolerance.outer_lr", "0"],
         "fault_tolerance.outer_lr = 0.0", "finite number > 0"),
    ],
)  # fmt: skip
def test_bad_semi_sync_settings_are_one_line_errors(
    argv: list[str], field: str, words: str
) -> None:
    with pytest.raises(ConfigError) as info:
        validate_fault_tolerance(_cfg(*argv))
    text = str(info.value)
    assert text.startswith(field) and words in text and "Fix:" in text and "\n" not in text


def test_good_semi_sync_settings_pass() -> None:
    validate_fault_tolerance(_cfg(*FT, "--fault_tolerance.semi_sync", "diloco"))
    validate_fault_tolerance(
        _cfg(*FT, "--fault_tolerance.semi_sync", "local_sgd", "--fault_tolerance.sync_every", "8")
    )
    validate_fault_tolerance(_cfg())  # off: nothing to check


def test_explain_names_the_sync_traffic_and_diloco_state() -> None:
    """debugmodel's fp32 shard on 1 rank: DiLoCo every 4 steps sends a quarter of a
    synchronous step's bytes per step on average; its outer state is named with its size."""
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.fault_tolerance.explain import MIB, fault_tolerance_lines

    n = 1_000_000
    shard = n * 4 / MIB
    dims = ParallelDims.from_config(_cfg().parallelism, 1)
    sync = fault_tolerance_lines(_cfg(*FT), dims, n)
    assert f"~{shard:,.1f} MiB sent per step" in sync[1]  # 2 groups: ring 2 x 1/2 x shard
    assert "flattened gradient copy" in sync[2]
    lines = fault_tolerance_lines(
        _cfg(*FT, "--fault_tolerance.semi_sync", "diloco", "--fault_tolerance.sync_every", "4"),
        dims,
        n,
    )
    text = "\n".join(lines)
    assert "every 4 steps each rank all-reduces its" in text and "pseudo-gradient" in text
    assert f"~{shard:,.1f} MiB sent per sync, ~{shard / 4:,.1f} MiB per step" in text
    assert "SGD lr 0.7, Nesterov momentum 0.9" in text
    assert f"last synced weights {shard:,.1f} MiB (host)" in text
    assert f"outer momentum {shard:,.1f} MiB" in text
    # device: the momentum all step + pseudo-gradients and local weights at a sync
    assert f"device {3 * shard:,.1f} MiB ({shard:,.1f} MiB all step)" in text
    # host: the recovery buffer (parameters + two moments) and the last synced weights
    assert f"host {4 * shard:,.1f} MiB" in text


def test_memory_estimate_counts_recovery_buffer_and_diloco_state() -> None:
    """The planner's per-rank estimate: fault tolerance adds the recovery buffer to host
    memory and the all-reduce's gradient copy to the optimizer step; DiLoCo adds its outer
    momentum (all step, device) and its last synced weights (host)."""
    from torchtitan.planner.estimator import estimate_memory

    def est(*argv: str):  # noqa: ANN202
        return estimate_memory(_cfg(*argv), 1, device_type="cpu")

    plain = est()
    ft = est(*FT)
    diloco = est(*FT, "--fault_tolerance.semi_sync", "diloco")
    no_momentum = est(
        *FT, "--fault_tolerance.semi_sync", "diloco", "--fault_tolerance.outer_momentum", "0"
    )
    params, moments = plain.parameters, plain.optimizer_states
    assert params > 0 and moments == 2 * params  # fp32 AdamW
    assert plain.host == 0 and ft.host == params + moments  # the recovery buffer
    assert ft.optimizer_states == moments
    assert diloco.optimizer_states == moments + params  # the outer Nesterov momentum
    assert no_momentum.optimizer_states == moments
    assert diloco.host == 2 * params + moments  # + the last synced weights
    assert ft.total >= plain.total and diloco.total > ft.total
    assert any("DiLoCo" in note for note in diloco.notes)
    # the copies made at the cross-group reduction join the optimizer step's moment
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.planner.estimator import model_args_for
    from torchtitan.planner.rank_memory import RankMemory

    def at_step(*argv: str) -> int:
        cfg = _cfg(*argv)
        dims = ParallelDims.from_config(cfg.parallelism, 1)
        return RankMemory(cfg, model_args_for(cfg), dims, None, 0, "cpu", True).ft_sync

    assert at_step() == 0
    assert at_step(*FT) == params  # the flattened fp32 gradients
    assert at_step(*FT, "--fault_tolerance.semi_sync", "local_sgd") == params
    assert at_step(*FT, "--fault_tolerance.semi_sync", "diloco") == 2 * params


def test_only_diloco_adds_a_checkpoint_part() -> None:
    """Fault tolerance off, synchronous, or LocalSGD (whose only state, the inner-step count,
    follows from the step): the checkpoint holds what it held before; DiLoCo adds ``diloco``."""
    from torch import nn

    from torchtitan.fault_tolerance.outer_state import checkpoint_parts

    parts = [nn.Linear(2, 2)]
    assert checkpoint_parts(_cfg().fault_tolerance, parts) == {}
    assert checkpoint_parts(_cfg(*FT).fault_tolerance, parts) == {}
    local = _cfg(*FT, "--fault_tolerance.semi_sync", "local_sgd")
    assert checkpoint_parts(local.fault_tolerance, parts) == {}
    diloco = _cfg(*FT, "--fault_tolerance.semi_sync", "diloco")
    assert list(checkpoint_parts(diloco.fault_tolerance, parts)) == ["diloco"]


class _Manager:
    """What torchft's DiLoCo and LocalSGD read of a Manager at construction."""

    _use_async_quorum = False

    def register_state_dict_fn(self, *args: object) -> None:
        pass


def _diloco(model: Any, step: int, outer_state: Any = None) -> Any:
    """SemiSync (torchft's DiLoCo, sync every 3) over ``model``, resumed after ``step``."""
    from torchtitan.fault_tolerance.semi_sync import SemiSync

    ft = _cfg(*FT, "--fault_tolerance.semi_sync", "diloco", "--fault_tolerance.sync_every", "3")
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    return SemiSync(ft.fault_tolerance, _Manager(), [model], inner, step, outer_state)


def _inner_steps(semi: Any, seed: int) -> None:
    """What inner steps do to the weights: move them."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in semi.algorithm._fragments[0]._model_fragment.parameters():
            p.add_(torch.randn(p.shape, generator=g), alpha=0.1)


def _sync(semi: Any) -> None:
    """torchft's DiLoCo sync without the all-reduce (one group): pseudo-gradients against the
    last synced weights, the outer Nesterov step, the new synced weights."""
    fragment = semi.algorithm._fragments[0]
    fragment._save_grads()
    fragment._set_grads()
    fragment._outer_optimizer.step()
    fragment._outer_optimizer.zero_grad()
    fragment.save_parameters()


def _weights(semi: Any) -> list[torch.Tensor]:
    return [p.detach().clone() for p in semi.algorithm._fragments[0]._model_fragment.parameters()]


def _model(weights: list[torch.Tensor] | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
    if weights is not None:  # the model part of a checkpoint
        with torch.no_grad():
            for p, w in zip(model.parameters(), weights, strict=True):
                p.copy_(w)
    return model


def test_diloco_outer_state_round_trips_through_its_checkpoint_part() -> None:
    """A run saves mid-interval (an outer step taken, then inner steps): its ``diloco`` part
    (last synced weights, Nesterov momentum) under the checkpoint's parameter names. Loaded
    into a fresh run before torchft's DiLoCo exists, it is what the resumed run holds and
    saves; the next sync of both runs gives the same weights bit for bit, and without the
    loaded part it would not. The resumed inner-step count is the step modulo sync_every."""
    from torchtitan.fault_tolerance.outer_state import OuterState

    ft = _cfg(*FT, "--fault_tolerance.semi_sync", "diloco").fault_tolerance
    first_model = _model()
    first_state = OuterState(ft, [first_model])
    first = _diloco(first_model, 0, first_state)
    _inner_steps(first, 1)
    _sync(first)
    _inner_steps(first, 2)  # the checkpoint: synced weights != weights, momentum != 0
    saved = {k: {n: t.clone() for n, t in d.items()} for k, d in first_state.state_dict().items()}
    weights = _weights(first)
    assert set(saved["synced"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert all(not torch.equal(saved["synced"][n], w) for n, w in zip(saved["synced"], weights))
    assert all(m.abs().sum() > 0 for m in saved["momentum"].values())

    resumed_model = _model(weights)
    loaded = OuterState(ft, [resumed_model])
    targets = loaded.state_dict()  # what DCP loads into: shaped like the saved entries
    for kind, entries in targets.items():
        for name, t in entries.items():
            t.copy_(saved[kind][name])
    loaded.load_state_dict(targets)
    second = _diloco(resumed_model, 7, loaded)
    assert second.algorithm._local_step == 7 % 3
    again = loaded.state_dict()  # what the resumed run would save now
    for kind, entries in saved.items():
        for name, t in entries.items():
            assert torch.equal(again[kind][name], t), (kind, name)

    no_state = _diloco(_model(weights), 7)  # a resume that ignores the part
    for semi in (first, second, no_state):
        _inner_steps(semi, 3)
        _sync(semi)
    for a, b in zip(_weights(first), _weights(second), strict=True):
        assert torch.equal(a, b)
    worst = max(
        float((a - b).abs().max()) for a, b in zip(_weights(first), _weights(no_state), strict=True)
    )
    assert worst > 1e-3, worst
