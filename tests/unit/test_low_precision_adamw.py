"""The low-precision AdamW (docs/memory.md): equals torch's AdamW in fp32, halves the moment
bytes in bf16 while following the fp32 trajectory, rounds without bias, and round-trips its
state (dtype included) through state_dict."""

from __future__ import annotations

import copy

import pytest
import torch

from torchtitan.optim.low_precision_adamw import LowPrecisionAdamW, stochastic_round_to_bf16

KW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _problem(seed: int = 0, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(64, 32, generator=g)
    w = torch.nn.Parameter(torch.randn(64, 32, generator=g).to(dtype))
    return w, target


def _train(opt: torch.optim.Optimizer, w: torch.Tensor, target: torch.Tensor, steps: int) -> float:
    for _ in range(steps):
        opt.zero_grad()
        loss = ((w.float() - target) ** 2).mean()
        loss.backward()
        opt.step()
    return ((w.float() - target) ** 2).mean().item()


@pytest.mark.parametrize("decoupled", [True, False])
def test_fp32_equals_torch_adamw(decoupled: bool) -> None:
    w1, t = _problem()
    w2, _ = _problem()
    ref_cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    ref = ref_cls([w1], foreach=False, **KW)  # type: ignore[arg-type]
    ours = LowPrecisionAdamW([w2], moments_dtype=torch.float32, decoupled=decoupled, **KW)  # type: ignore[arg-type]
    _train(ref, w1, t, 20)
    _train(ours, w2, t, 20)
    assert torch.equal(w1, w2)


@pytest.mark.smoke
def test_bf16_moments_halve_state_and_track_fp32() -> None:
    w1, t = _problem()
    w2, _ = _problem()
    fp32 = LowPrecisionAdamW([w1], moments_dtype=torch.float32, **KW)  # type: ignore[arg-type]
    bf16 = LowPrecisionAdamW([w2], moments_dtype=torch.bfloat16, **KW)  # type: ignore[arg-type]
    l1, l2 = _train(fp32, w1, t, 100), _train(bf16, w2, t, 100)
    nbytes = [
        sum(s[k].nbytes for k in ("exp_avg", "exp_avg_sq"))
        for s in (fp32.state[w1], bf16.state[w2])
    ]
    assert nbytes[1] * 2 == nbytes[0]
    assert abs(l2 - l1) <= 0.01 * l1, (l1, l2)


def test_bf16_master_weights_train() -> None:
    w1, t = _problem()
    w2, _ = _problem(dtype=torch.bfloat16)
    l1 = _train(LowPrecisionAdamW([w1], moments_dtype=torch.float32, **KW), w1, t, 100)  # type: ignore[arg-type]
    l2 = _train(LowPrecisionAdamW([w2], moments_dtype=torch.float32, **KW), w2, t, 100)  # type: ignore[arg-type]
    assert w2.dtype == torch.bfloat16
    assert abs(l2 - l1) <= 0.05 * l1 + 1e-3, (l1, l2)


def test_stochastic_rounding_is_unbiased() -> None:
    x = torch.full((200_000,), 1.0 + 2**-10)  # a quarter of the way between two bf16 values
    r = stochastic_round_to_bf16(x, torch.Generator().manual_seed(0)).float()
    assert set(r.unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert abs(r.mean().item() - x[0].item()) < 2e-5
    exact = torch.tensor([0.5, -3.0, 0.0])
    assert torch.equal(stochastic_round_to_bf16(exact, torch.Generator()).float(), exact)


def test_state_dict_round_trip_is_bitwise_and_keeps_bf16() -> None:
    w1, t = _problem()
    opt = LowPrecisionAdamW([w1], moments_dtype=torch.bfloat16, **KW)  # type: ignore[arg-type]
    _train(opt, w1, t, 5)
    sd = copy.deepcopy(opt.state_dict())  # as a checkpoint would: no shared tensors
    w2 = torch.nn.Parameter(w1.detach().clone())
    opt2 = LowPrecisionAdamW([w2], moments_dtype=torch.bfloat16, **KW)  # type: ignore[arg-type]
    opt2.load_state_dict(sd)
    assert opt2.state[w2]["exp_avg"].dtype == torch.bfloat16
    _train(opt, w1, t, 5)
    _train(opt2, w2, t, 5)
    assert torch.equal(w1, w2)
    assert torch.equal(opt.state[w1]["exp_avg_sq"], opt2.state[w2]["exp_avg_sq"])


@pytest.mark.parametrize(
    "argv, world, field",
    [
        # Offload on one rank is FSDP on a 1-rank mesh (accepted); pure DDP is refused.
        (
            ["--parallelism.fsdp_cpu_offload", "--parallelism.data_parallel_replicate_degree=2"],
            2,
            "parallelism.fsdp_cpu_offload",
        ),
        (
            [
                "--optimizer.master_weights_dtype=bfloat16",
                "--training.mixed_precision_param=float32",
            ],
            1,
            "training.mixed_precision_param",
        ),
    ],
)
def test_preflight_refuses(argv: list[str], world: int, field: str) -> None:
    from torchtitan.config.errors import ConfigError
    from torchtitan.preflight.validate import load_config

    with pytest.raises(ConfigError) as err:
        load_config(
            ["--job.config_file", "train_configs/debug_model.toml", *argv], world_size=world
        )
    assert err.value.field == field


def test_fp32_moments_beside_bf16_weights_survive_state_dict() -> None:
    w1, t = _problem(dtype=torch.bfloat16)
    opt = LowPrecisionAdamW([w1], moments_dtype=torch.float32, **KW)  # type: ignore[arg-type]
    _train(opt, w1, t, 3)
    w2 = torch.nn.Parameter(w1.detach().clone())
    opt2 = LowPrecisionAdamW([w2], moments_dtype=torch.float32, **KW)  # type: ignore[arg-type]
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    for key in ("exp_avg", "exp_avg_sq"):
        assert opt2.state[w2][key].dtype == torch.float32
        assert torch.equal(opt2.state[w2][key], opt.state[w1][key])
