"""Muon on one process against the published algorithm and ``torch.optim.Muon``; the parameter
groups (kinds, default decay, rules, errors) and their per-group schedules (docs/optimizers.md)."""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch import nn

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig, LRScheduler, Optimizer, OptimizerGroup
from torchtitan.models import MODELS
from torchtitan.optim.lr_scheduler import build_lr_scheduler
from torchtitan.optim.optimizer import build_optimizer, named_params
from torchtitan.preflight.validate_optim import validate_optimizer

A, B, C = 3.4445, -4.7750, 2.0315  # Keller Jordan's quintic Newton-Schulz coefficients


class _Experts(nn.Module):
    param_kind = "experts"

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 6, 10))


class _Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 6)
        self.up = nn.Linear(6, 12, bias=True)
        self.norm = nn.RMSNorm(12)
        self.down = nn.Linear(12, 6, bias=False)
        self.experts = _Experts()
        self.out = nn.Linear(6, 16, bias=False)


def _toy_optimizer(model: nn.Module, **kw) -> torch.optim.Optimizer:
    cfg = Optimizer(name="Muon", lr=0.02, weight_decay=0.1, muon_ns_dtype="float32", **kw)
    return build_optimizer([model], cfg, output="out", embedding="emb")


# ------------------------------------------------------------------ the published algorithm
def _ns_reference(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Newton-Schulz as published (Keller Jordan, "Muon", 2024), one matrix, fp32."""
    x = g.clone()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / max(float(torch.linalg.matrix_norm(x)), 1e-7)
    for _ in range(steps):
        s = x @ x.T
        x = A * x + (B * s + C * s @ s) @ x
    return x.T if tall else x


def _reference_step(params: dict, grads: dict, state: dict, t: int, kinds: dict) -> None:
    lr, wd, mu, b1, b2, eps = 0.02, 0.1, 0.95, 0.9, 0.95, 1e-8
    for name, p in params.items():
        g, kind = grads[name], kinds[name]
        decay = wd if kind in ("matrix", "experts", "output") else 0.0
        if kind in ("matrix", "experts"):  # Muon (Nesterov), Moonlight's RMS-matching scale
            m = state.setdefault(name, torch.zeros_like(p))
            m.mul_(mu).add_(g, alpha=1 - mu)
            u = (1 - mu) * g + mu * m
            mats = [u] if u.ndim == 2 else list(u)
            o = torch.stack([_ns_reference(x) for x in mats]).reshape(u.shape)
            scale = 0.2 * math.sqrt(max(p.shape[-2], p.shape[-1]))
            p.mul_(1 - lr * decay).sub_(lr * scale * o)
        else:  # AdamW (Loshchilov & Hutter), bias-corrected moments
            m1, m2 = state.setdefault(name, (torch.zeros_like(p), torch.zeros_like(p)))
            m1.mul_(b1).add_(g, alpha=1 - b1)
            m2.mul_(b2).add_(g * g, alpha=1 - b2)
            denom = (m2 / (1 - b2**t)).sqrt() + eps
            p.mul_(1 - lr * decay).sub_(lr * (m1 / (1 - b1**t)) / denom)


def test_muon_matches_published_algorithm() -> None:
    torch.manual_seed(0)
    model = _Toy()
    opt = _toy_optimizer(model)
    kinds = {n: k for n, _, k in named_params([model], "out", "emb")}
    assert kinds == {
        "emb.weight": "embedding",
        "up.weight": "matrix",
        "up.bias": "bias",
        "norm.weight": "norm",
        "down.weight": "matrix",
        "experts.w": "experts",
        "out.weight": "output",
    }
    ref = {n: p.detach().clone() for n, p in model.named_parameters()}
    state: dict = {}
    gen = torch.Generator().manual_seed(1)
    for t in range(1, 6):
        grads = {n: torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}
        for n, p in model.named_parameters():
            p.grad = grads[n].clone()
        opt.step()
        _reference_step(ref, grads, state, t, kinds)
    for n, p in model.named_parameters():
        diff = (p.detach() - ref[n]).abs().max().item()
        assert diff <= 1e-6, f"{n}: {diff:.2e} from the reference after 5 steps"
    moved = (model.up.weight - _Toy().up.weight).abs().max()
    assert moved > 0.01  # the steps did move the weights


@pytest.mark.parametrize(
    "scale, torch_fn", [("match_rms_adamw", "match_rms_adamw"), ("original", "original")]
)
def test_muon_matches_torch_muon_on_matrices(scale: str, torch_fn: str) -> None:
    """Where the two overlap (2-D matrices, bf16 Newton-Schulz): equal after 5 steps."""
    torch.manual_seed(0)
    mats = [nn.Parameter(torch.randn(12, 6)), nn.Parameter(torch.randn(6, 20))]
    twins = [nn.Parameter(m.detach().clone()) for m in mats]
    model = nn.Module()
    model.a, model.b = nn.Linear(6, 12, bias=False), nn.Linear(20, 6, bias=False)
    model.a.weight, model.b.weight = mats
    cfg = Optimizer(name="Muon", lr=0.02, muon_ns_dtype="bfloat16", muon_update_scale=scale)  # type: ignore[arg-type]
    ours = build_optimizer([model], cfg)
    theirs = torch.optim.Muon(twins, lr=0.02, weight_decay=0.1, adjust_lr_fn=torch_fn)
    gen = torch.Generator().manual_seed(2)
    for _ in range(5):
        for p, q in zip(mats, twins):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        ours.step()
        theirs.step()
    for p, q in zip(mats, twins):
        assert (p - q).abs().max().item() <= 1e-6


# ------------------------------------------------------------------ groups
def _groups_of(model_name: str, flavor: str, o: Optimizer) -> list[dict]:
    spec = MODELS[model_name]
    args = spec.flavors[flavor]
    with torch.device("meta"):
        model = spec.build(args)
    plan = spec.parallel_plan(args)
    opt = build_optimizer([model], o, output=plan.tensor_parallel.output, embedding=plan.embedding)
    names = {id(p): n for n, p in model.named_parameters()}
    return [{**g, "names": [names[id(p)] for p in g["params"]]} for g in opt.param_groups], model  # type: ignore[return-value]


@pytest.mark.parametrize("name", ["AdamW", "Muon"])
@pytest.mark.parametrize(
    "model_name, flavor",
    [("llama3", "debugmodel"), ("qwen3", "debugmodel_moe"), ("gpt_oss", "debugmodel")],
)
def test_default_groups_never_decay_norms_biases_embeddings(name, model_name, flavor) -> None:
    groups, model = _groups_of(model_name, flavor, Optimizer(name=name, weight_decay=0.1))
    decay = {n: g["weight_decay"] for g in groups for n in g["names"]}
    algo = {n: g["algorithm"] for g in groups for n in g["names"]}
    # Found by module type here, independently of the kinds the optimizer assigned.
    norms = [f"{m}.{p}" for m, mod in model.named_modules() if isinstance(mod, nn.RMSNorm)
             for p, _ in mod.named_parameters(recurse=False)]  # fmt: skip
    embeddings = [
        f"{m}.weight" for m, mod in model.named_modules() if isinstance(mod, nn.Embedding)
    ]
    assert norms and embeddings
    for n in norms + embeddings:
        assert decay[n] == 0.0, f"{n} is decayed by the default groups ({decay[n]})"
        assert algo[n] == "adamw"
    assert decay["output.weight"] == 0.1 and algo["output.weight"] == "adamw"
    biases = [n for n, _ in model.named_parameters() if n.endswith("bias")]
    own = [n for n in biases if "router" not in n]  # the router's bias follows the router kind
    assert all(decay[n] == 0.0 and algo[n] == "adamw" for n in own), own
    matrices = [n for n, p in model.named_parameters() if p.ndim >= 2 and "router" not in n
                and n not in embeddings + biases and n != "output.weight"]  # fmt: skip
    assert all(decay[n] == 0.1 for n in matrices)
    assert all(algo[n] == ("muon" if name == "Muon" else "adamw") for n in matrices)
    if model_name == "gpt_oss":  # its own expert class: expert matrices, biases apart
        kinds = {g["group"]: g for g in groups}
        assert any("experts.gate_up_proj" in n and not n.endswith("bias")
                   for g in groups if "experts" in g["group"] for n in g["names"]), kinds.keys()  # fmt: skip
    if model_name == "qwen3":
        assert algo["layers.0.feed_forward.router.gate.weight"] == "adamw"
        assert algo["layers.0.feed_forward.experts.w1"] == algo["layers.0.attention.wq.weight"]


def test_rules_first_match_wins_and_set_lr_and_decay() -> None:
    rules = [
        OptimizerGroup(names=["layers.0.*"], kinds=["matrix"], lr_mult=0.5, weight_decay=0.0),
        OptimizerGroup(kinds=["matrix"], optimizer="AdamW", lr_mult=2.0),
        OptimizerGroup(kinds=["norm"], weight_decay=0.01),
    ]
    groups, _ = _groups_of("llama3", "debugmodel", Optimizer(name="Muon", lr=1e-3, groups=rules))
    by_name = {n: g for g in groups for n in g["names"]}
    wq0, wq1 = by_name["layers.0.attention.wq.weight"], by_name["layers.1.attention.wq.weight"]
    assert (wq0["algorithm"], wq0["lr"], wq0["weight_decay"]) == ("muon", 5e-4, 0.0)
    assert (wq1["algorithm"], wq1["lr"], wq1["weight_decay"]) == ("adamw", 2e-3, 0.1)
    assert by_name["norm.weight"]["weight_decay"] == 0.01
    assert by_name["tok_embeddings.weight"]["weight_decay"] == 0.0  # untouched default


def _cfg(*rules: OptimizerGroup, name: str = "Muon") -> JobConfig:
    cfg = JobConfig()
    cfg.optimizer.name = name  # type: ignore[assignment]
    cfg.optimizer.groups = list(rules)
    return cfg


@pytest.mark.parametrize(
    "rules, name, field, words",
    [
        ([OptimizerGroup(names=["no.such.*"])], "Muon", "optimizer.groups[0]", "matches no parameter"),
        ([OptimizerGroup(kinds=["norm"]), OptimizerGroup(names=["norm.weight"])], "Muon",
         "optimizer.groups[1]", "an earlier rule takes all"),  # fmt: skip
        ([OptimizerGroup(kinds=["norms"])], "Muon", "optimizer.groups[0].kinds", "no parameter kind"),
        ([OptimizerGroup(kinds=["norm"], optimizer="Muon")], "Muon", "optimizer.groups[0].kinds", "Muon takes only"),
        ([OptimizerGroup(kinds=["matrix"], optimizer="Muon")], "AdamW", "optimizer.groups[0].optimizer", "needs optimizer.name = Muon"),
        ([OptimizerGroup(lr_mult=0.0)], "Muon", "optimizer.groups[0].lr_mult", "> 0"),
        ([OptimizerGroup(weight_decay=-0.5)], "Muon", "optimizer.groups[0].weight_decay", ">= 0 or -1"),
        ([OptimizerGroup(names=[""])], "Muon", "optimizer.groups[0].names", "empty pattern"),
    ],
)  # fmt: skip
def test_bad_groups_are_config_errors(rules, name, field, words) -> None:
    with pytest.raises(ConfigError) as e:
        validate_optimizer(_cfg(*rules, name=name))
    assert e.value.field == field and words in str(e.value), str(e.value)


def test_muon_refuses_bf16_moments() -> None:
    cfg = _cfg()
    cfg.optimizer.moments_dtype = "bfloat16"
    with pytest.raises(ConfigError, match="optimizer.moments_dtype"):
        validate_optimizer(cfg)


def test_each_group_follows_the_schedule_times_its_multiplier() -> None:
    model = _Toy()
    rules = [
        OptimizerGroup(kinds=["embedding"], lr_mult=0.25),
        OptimizerGroup(kinds=["output"], lr_mult=3.0),
    ]
    opt = _toy_optimizer(model, groups=rules)
    schedule = LRScheduler(warmup_steps=2, decay_ratio=0.5, decay_type="cosine", min_lr_factor=0.1)
    sched = build_lr_scheduler(opt, schedule, total_steps=10)
    seen = []
    for _ in range(10):
        base = {g["group"]: g["lr"] / g["lr_mult"] for g in opt.param_groups}
        assert len(set(round(v, 15) for v in base.values())) == 1, base
        seen.append(next(iter(base.values())))
        opt.step()
        sched.step()
    assert seen[1] == pytest.approx(0.02) and seen[2] == pytest.approx(0.02)  # peak, stable
    assert seen[-1] == pytest.approx(0.002)  # the floor: lr x min_lr_factor at the last step
    emb = next(g for g in opt.param_groups if g["group"] == "groups[0]")
    assert emb["lr"] == pytest.approx(0.25 * 0.002)


def test_estimator_counts_one_muon_buffer_and_the_gathers() -> None:
    """Muon's state: AdamW's 8 bytes per element of the embedding/head (R), 4 per block
    element (B), so 2 x Muon - AdamW = 8 R, R being the roots' shard: (2 vocab dim + dim) / 8."""
    from torchtitan.config.manager import parse_args
    from torchtitan.planner.estimator import estimate_memory

    est = {}
    for name in ("AdamW", "Muon"):
        argv = ["--job.config_file", "train_configs/llama3_8b.toml", "--optimizer.name", name]
        est[name] = estimate_memory(parse_args(argv), 8, device_type="cuda")
    vocab, dim = 2048, 4096  # the test tokenizer's vocabulary, Llama 3 8B's width
    roots = (2 * vocab * dim + dim) // 8
    assert 2 * est["Muon"].optimizer_states - est["AdamW"].optimizer_states == 8 * roots
    assert any("Muon" in n and "gathers" in n for n in est["Muon"].notes)


def test_explain_prints_the_muon_gather_buffer() -> None:
    """``--job.explain`` prints the estimate's notes: under Muon the gather buffer, with the
    same byte figure the estimator computed."""
    from torchtitan.config.manager import parse_args
    from torchtitan.planner.estimator import estimate_memory
    from torchtitan.planner.explain import explain

    argv = ["--job.config_file", "train_configs/debug_model.toml", "--optimizer.name", "Muon"]
    cfg = parse_args(argv)
    note = next(n for n in estimate_memory(cfg, 2, device_type="cpu").notes if "Muon" in n)
    lines = explain(cfg, 2, device_type="cpu").splitlines()
    start = lines.index("memory notes:")
    assert f"  - {note}" in lines[start + 1 :]
    size = re.search(r"its step gathers up to ([0-9.]+) (\w+) of matrices", note)
    assert size is not None and float(size.group(1)) > 0, note
    adamw = explain(parse_args(argv[:2]), 2, device_type="cpu")
    assert "gathers" not in adamw
