"""Llama 3 model: shapes, parameter counts, FLOPs, init determinism, pipeline-style splits, learning."""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from torchtitan.distributed.init_weights import init_params_deterministic
from torchtitan.models.common.attention import AttentionCore
from torchtitan.models.common.rope import precompute_freqs_cis
from torchtitan.models.llama3 import LLAMA3_FLAVORS, ModelArgs, Transformer

# Published parameter counts (Llama 3.2 1B, Llama 3.1 8B / 70B / 405B).
PUBLISHED_PARAMS = {"1B": 1.236e9, "8B": 8.03e9, "70B": 70.55e9, "405B": 405.85e9}
HIDDEN_DIMS = {"debugmodel": 768, "1B": 8192, "8B": 14336, "70B": 28672, "405B": 53248}


def tiny_args(**overrides: object) -> ModelArgs:
    base = dataclasses.replace(LLAMA3_FLAVORS["debugmodel"], n_layers=2, max_seq_len=64)
    return dataclasses.replace(base, **overrides)  # type: ignore[arg-type]


def build(args: ModelArgs, seed: int = 0) -> Transformer:
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    return model


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("flavor", sorted(LLAMA3_FLAVORS))
def test_num_params_matches_module(flavor: str) -> None:
    args = LLAMA3_FLAVORS[flavor]
    assert args.hidden_dim == HIDDEN_DIMS[flavor]
    with torch.device("meta"):
        model = Transformer(args)
    counted = sum(p.numel() for p in model.parameters())
    assert counted == args.num_params()
    embedding = model.tok_embeddings.weight.numel()  # type: ignore[union-attr]
    if args.tie_word_embeddings:
        assert model.output.weight is model.tok_embeddings.weight  # type: ignore[union-attr]
        assert args.num_params(exclude_embedding=True) == counted
    else:
        assert args.num_params(exclude_embedding=True) == counted - embedding
    if flavor in PUBLISHED_PARAMS:
        published = PUBLISHED_PARAMS[flavor]
        assert abs(counted - published) / published < 0.005, (flavor, counted, published)


def test_flops_per_token_8b() -> None:
    a = LLAMA3_FLAVORS["8B"]
    seq = 8192
    non_embedding = a.num_params() - a.vocab_size * a.dim
    expected = 6 * non_embedding + 12 * 32 * 32 * 128 * seq
    assert a.flops_per_token(seq) == expected
    # ~57.9 GFLOP per token: 45.0 G from the weights, 12.9 G from attention at 8k context.
    assert 5.7e10 < a.flops_per_token(seq) < 5.9e10
    assert a.flops_per_token(2 * seq) - a.flops_per_token(seq) == 12 * 32 * 4096 * seq


def test_bad_shapes_rejected() -> None:
    with pytest.raises(ValueError, match="n_kv_heads"):
        ModelArgs(dim=256, n_heads=16, n_kv_heads=3)
    with pytest.raises(ValueError, match="n_heads"):
        ModelArgs(dim=250, n_heads=16)


def test_freqs_cis_table() -> None:
    table = precompute_freqs_cis(64, 16, theta=10000.0)
    assert table.shape == (16, 32) and table.dtype == torch.complex64
    assert torch.allclose(table.abs(), torch.ones(16, 32))
    assert torch.allclose(torch.angle(table[1, 0]), torch.tensor(1.0))
    scaled = precompute_freqs_cis(64, 16, 500000.0, scaling_factor=8.0)
    plain = precompute_freqs_cis(64, 16, 500000.0)
    # Highest frequency untouched, lowest divided by the factor.
    assert torch.allclose(scaled[:, 0], plain[:, 0])
    assert torch.allclose(torch.angle(scaled[1, -1]) * 8, torch.angle(plain[1, -1]))


def test_debug_forward_shape_and_causality() -> None:
    args = LLAMA3_FLAVORS["debugmodel"]
    model = build(dataclasses.replace(args, max_seq_len=64))
    assert model.freqs_cis.shape == (64, args.head_dim // 2)
    tokens = torch.randint(0, args.vocab_size, (2, 32))
    with torch.no_grad():
        logits = model(tokens)
        assert logits.shape == (2, 32, args.vocab_size)
        changed = tokens.clone()
        changed[:, 20] = (changed[:, 20] + 1) % args.vocab_size
        logits2 = model(changed)
    assert torch.allclose(logits[:, :20], logits2[:, :20], atol=1e-5)
    assert not torch.allclose(logits[:, 20:], logits2[:, 20:], atol=1e-3)


def test_gqa_forward_and_positions() -> None:
    args = tiny_args(n_kv_heads=4)
    model = build(args)
    wk = model.get_parameter("layers.0.attention.wk.weight")
    assert wk.shape == (4 * args.head_dim, args.dim)
    assert isinstance(model.get_submodule("layers.0.attention.core"), AttentionCore)
    tokens = torch.randint(0, args.vocab_size, (2, 16))
    with torch.no_grad():
        default = model(tokens)
        flat = model(tokens, positions=torch.arange(16))
        batched = model(tokens, positions=torch.arange(16).expand(2, 16))
        shifted = model(tokens, positions=torch.arange(16) + 5)
    assert default.shape == (2, 16, args.vocab_size)
    assert torch.equal(default, flat) and torch.equal(default, batched)
    assert not torch.allclose(default, shifted)


def test_meta_init_is_deterministic() -> None:
    args = tiny_args()
    a, b, c = build(args, seed=3), build(args, seed=3), build(args, seed=4)
    torch.manual_seed(123)  # built directly on CPU: the default init is overwritten
    direct = Transformer(args)
    direct.init_weights(3)
    pa, pb, pc, pd = params(a), params(b), params(c), params(direct)
    assert pa.keys() == pb.keys() == pc.keys() == pd.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]) and torch.equal(pa[name], pd[name]), name
        if "norm" not in name:
            assert not torch.equal(pa[name], pc[name]), name
    assert torch.equal(a.freqs_cis, direct.freqs_cis)
    # Spot-check the rules: embedding std 1, depth-scaled output projections, norms at one.
    assert abs(pa["tok_embeddings.weight"].std().item() - 1.0) < 0.02
    assert torch.equal(pa["layers.1.ffn_norm.weight"], torch.ones(args.dim))
    wo = pa["layers.1.attention.wo.weight"]
    assert wo.abs().max() <= 3 * 0.02 / math.sqrt(4) + 1e-6


def test_tied_embeddings_survive_to_empty() -> None:
    args = tiny_args(tie_word_embeddings=True)
    model = build(args)
    assert model.output.weight is model.tok_embeddings.weight  # type: ignore[union-attr]
    assert list(model.weight_init_plan()) == [n for n, _ in model.named_parameters()]
    assert sum(p.numel() for p in model.parameters()) == args.num_params()
    with torch.no_grad():
        assert model(torch.randint(0, args.vocab_size, (1, 8))).shape == (1, 8, args.vocab_size)


def test_dtype_cast_keeps_complex_rope_table() -> None:
    model = build(tiny_args())
    # torch warns about casting the complex buffer, but only once per process (TORCH_WARN_ONCE),
    # so whether it shows here depends on which tests ran before: not asserted.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        model.to(torch.float64)
    assert model.freqs_cis.dtype == torch.complex64
    assert torch.equal(model.freqs_cis, precompute_freqs_cis(16, 64, 500000.0))


def test_pipeline_style_split() -> None:
    args = dataclasses.replace(LLAMA3_FLAVORS["debugmodel"], max_seq_len=64)
    full = build(args, seed=7)
    full_params = params(full)
    tokens = torch.randint(0, args.vocab_size, (2, 16))

    with torch.device("meta"):
        first = Transformer(args)
        last = Transformer(args)
    for key in ("3", "4", "5"):
        del first.layers[key]
    first.norm = None
    first.output = None
    for key in ("0", "1", "2"):
        del last.layers[key]
    last.tok_embeddings = None
    for stage in (first, last):
        stage.to_empty(device="cpu")
        stage.init_buffers()
        plan = stage.weight_init_plan()
        assert set(plan) == {n for n, _ in stage.named_parameters()}
        init_params_deterministic(stage, plan, seed=7)
        for name, value in params(stage).items():
            assert torch.equal(value, full_params[name]), name
    assert "output.weight" not in first.weight_init_plan()
    assert "layers.5.feed_forward.w2.weight" in last.weight_init_plan()

    with torch.no_grad():
        hidden = first(tokens)
        assert hidden.shape == (2, 16, args.dim)
        logits = last(hidden)
        reference = full(tokens)
    assert torch.allclose(logits, reference, atol=1e-5)


def test_adamw_learns() -> None:
    torch.manual_seed(0)
    args = tiny_args(dim=64, n_heads=4, vocab_size=128, max_seq_len=32)
    model = build(args, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.randint(0, args.vocab_size, (4, 33))
    inputs, labels = data[:, :-1], data[:, 1:]
    losses = []
    for _ in range(15):
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > math.log(args.vocab_size) * 0.9
    assert losses[-1] < 0.5 * losses[0], losses
