"""GPT-OSS: published sizes, the ModelSpec contract, YaRN against transformers' rope init, and
logits, loss and every gradient equal to transformers' GptOssForCausalLM through the state-dict
adapter (fp32), in both directions, on a tiny random config whose sliding window (8) is shorter
than the sequence (40), so windows, sinks, biases and the expert clamp all matter (the clamp,
0.5 here, cuts 2-7% of the gate/up entries of the import test, measured)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests import hf_parity
from tests.spec_checks import built_on_meta
from tests.tiny_args import tiny_gpt_oss
from torchtitan.models.common.hf import StateDictAdapter
from torchtitan.models.common.rope import YarnScaling, precompute_yarn_freqs_cis
from torchtitan.models.gpt_oss import GPT_OSS_FLAVORS, GptOssArgs, Transformer
from torchtitan.models.gpt_oss.hf import GPT_OSS_HF

transformers = pytest.importorskip("transformers")
TINY = tiny_gpt_oss()


@pytest.mark.parametrize(
    ("flavor", "total", "active"), [("20b", 20.91, 3.61), ("120b", 116.83, 5.13)]
)
def test_published_sizes(flavor: str, total: float, active: float) -> None:
    args = GPT_OSS_FLAVORS[flavor]
    assert args.num_params() / 1e9 == pytest.approx(total, abs=0.01)
    embedding = args.vocab_size * args.dim
    assert (args.num_params(active=True) - embedding) / 1e9 == pytest.approx(active, abs=0.01)


def test_spec_counts_plan_and_flops() -> None:
    spec, args, model, plan, blocks = built_on_meta("gpt_oss", "debugmodel")
    for path in plan.tensor_parallel.block:
        blocks["0"].get_submodule(path)
    assert plan.context_parallel is None and plan.document_mask
    # Sliding layers (half of them) reach min(window, seq) keys: at seq 4 x window, the
    # attention term is (1 + 1/4) / 2 of the all-full count.
    seq, w = 4 * args.sliding_window, args.sliding_window
    full = 12 * args.n_heads * args.head_dim * args.n_layers * seq
    dense = 6 * args.num_params(exclude_embedding=True, active=True)
    assert spec.flops_per_token(args, seq) - dense == full * (seq + w) // (2 * seq)


@pytest.mark.parametrize("truncate", [True, False])
def test_yarn_matches_transformers(truncate: bool) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0}
    rope |= {"beta_slow": 1.0, "truncate": truncate, "original_max_position_embeddings": 4096}
    config = transformers.GptOssConfig(
        hidden_size=2880, num_attention_heads=64, head_dim=64, rope_parameters=rope
    )
    inv_freq, scale = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    yarn = YarnScaling(32.0, 4096, beta_fast=32.0, beta_slow=1.0, truncate=truncate)
    ours = precompute_yarn_freqs_cis(64, 2, 150000.0, yarn)
    torch.testing.assert_close(ours[1].angle(), inv_freq, rtol=1e-6, atol=0)
    torch.testing.assert_close(ours.abs(), torch.full_like(ours.abs(), scale))


def _hf_model(args: GptOssArgs, seed: int):
    config = transformers.GptOssConfig(**StateDictAdapter(GPT_OSS_HF, args).hf_config())
    torch.manual_seed(seed)
    hf = transformers.GptOssForCausalLM(config)
    with torch.no_grad():  # everything random, biases and sinks included
        for p in hf.parameters():
            p.normal_(0.0, 0.3 if p.dim() == 1 else 0.1)
    hf.config._attn_implementation = "eager"
    return hf.eval()


def test_import_matches_transformers_logits_loss_and_grads(tmp_path: Path) -> None:
    hf = _hf_model(TINY, seed=0)
    args, ours, _ = hf_parity.import_hf(hf, tmp_path)
    ours.eval()
    assert args.layer_types == TINY.layer_types and args.yarn == TINY.yarn
    tokens, labels = hf_parity.tokens(), hf_parity.tokens().roll(1, dims=1)
    logits, hf_logits = ours(tokens), hf(tokens).logits
    diff = (logits - hf_logits).abs().max().item()
    print(f"transformers -> ours: max abs logit diff {diff:.2e}")
    assert diff <= 1e-5, diff
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    hf_loss = F.cross_entropy(hf_logits.flatten(0, 1), labels.flatten())
    loss.backward()
    hf_loss.backward()
    assert abs(loss.item() - hf_loss.item()) <= 1e-6 * abs(hf_loss.item())
    adapter = StateDictAdapter(GPT_OSS_HF, args)
    grads = adapter.to_hf({n: p.grad for n, p in ours.named_parameters() if p.grad is not None})
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    assert set(grads) == set(hf_grads)
    rel = {n: ((grads[n] - g).abs().max() / g.abs().max()).item() for n, g in hf_grads.items()}
    worst = max(rel, key=rel.__getitem__)
    print(f"loss {loss.item():.6f} vs {hf_loss.item():.6f}; worst grad {worst}: {rel[worst]:.2e}")
    assert rel[worst] <= 1e-4, (worst, rel[worst])


def test_export_matches_transformers_logits(tmp_path: Path) -> None:
    model = Transformer(TINY)
    model.init_weights(seed=3)
    with torch.no_grad():  # non-zero biases and sinks, so a wrong mapping would show
        gen = torch.Generator().manual_seed(3)
        for p in model.parameters():
            if p.dim() == 1 or p.dim() == 2 and p.shape[0] == TINY.moe.num_experts:  # vectors
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
    adapter = StateDictAdapter(GPT_OSS_HF, TINY)
    diff = hf_parity.export_logit_diff(model, adapter, transformers.GptOssForCausalLM, tmp_path)
    print(f"ours -> transformers: max abs logit diff {diff:.2e}")
    assert diff <= 1e-5, diff


def test_hf_round_trip_is_bit_identical(tmp_path: Path) -> None:
    hf = _hf_model(TINY, seed=1)
    args, ours, hf_sd = hf_parity.import_hf(hf, tmp_path)
    back = StateDictAdapter(GPT_OSS_HF, args).to_hf(dict(ours.state_dict()))
    assert set(back) == set(hf_sd) and all(torch.equal(back[k], hf_sd[k]) for k in hf_sd)


def test_block_causal_equals_documents_alone() -> None:
    """With doc_ids each document's logits equal those of the document run by itself (window
    and sinks applied within documents)."""
    model = Transformer(TINY)
    model.init_weights(seed=5)
    tokens = hf_parity.tokens()[:1]
    doc_ids = torch.zeros_like(tokens)
    doc_ids[:, 15:] = 1
    with torch.no_grad():
        packed = model(tokens, doc_ids=doc_ids, positions=torch.arange(40))
        first = model(tokens[:, :15])
        second = model(tokens[:, 15:], positions=torch.arange(15, 40))
    torch.testing.assert_close(packed, torch.cat([first, second], dim=1), rtol=1e-5, atol=1e-5)


def test_greedy_generation_with_cache_equals_without_and_transformers(tmp_path: Path) -> None:
    """A 12-token prompt and 20 new tokens, the sliding window (8) cutting in the prefill and in
    every decoded step: with the KV cache, without it, read back from an HF folder through
    ``scripts/generate.py``, and transformers' own greedy ``generate`` give the same tokens."""
    from safetensors.torch import save_file

    from tests.script_loader import load

    gen = load("scripts/generate.py")
    model = Transformer(TINY)
    model.init_weights(seed=7)
    with torch.no_grad():  # larger weights than the init: a varied greedy continuation
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.3)
    prompt = hf_parity.tokens()[:, :12]
    cached = gen.generate(model.eval(), prompt, 20)
    assert torch.equal(cached, gen.generate(model, prompt, 20, use_cache=False))
    assert len(set(cached[0, 12:].tolist())) > 3, "degenerate continuation"

    adapter = StateDictAdapter(GPT_OSS_HF, TINY)
    save_file(adapter.to_hf(dict(model.state_dict())), str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(adapter.hf_config()))
    args, sd = gen.load_weights(tmp_path, hf=True, flavor="")
    loaded = gen.build_model(args, sd, torch.device("cpu"), torch.float32, model_name="gpt_oss")
    assert torch.equal(gen.generate(loaded, prompt, 20), cached)
    hf = transformers.GptOssForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    theirs = hf.generate(prompt, max_new_tokens=20, min_new_tokens=20, do_sample=False)
    assert torch.equal(theirs, cached), (theirs, cached)


def test_context_parallel_is_refused_in_preflight() -> None:
    from torchtitan.config import ConfigError, parse_args
    from torchtitan.preflight.validate import validate_config

    argv = ["--model.name", "gpt_oss", "--model.flavor", "debugmodel"]
    cfg = parse_args([*argv, "--parallelism.context_parallel_degree", "2"])
    with pytest.raises(ConfigError, match="does not support context parallel"):
        validate_config(cfg, world_size=2)


# Uncompiled on purpose (the math, not the kernel): torch says so once per process; expected here.
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile:UserWarning")
@pytest.mark.parametrize("window", [None, 5])
def test_flex_kernel_matches_the_eager_path(window: int | None, monkeypatch) -> None:
    """The CUDA kernel's math on CPU (FlexAttention uncompiled, forward only: torch 2.13 has no
    CPU backward): the log-sum-exp rescaling by the sinks, the window and the document mask
    give the eager path's output."""
    from torch.nn.attention.flex_attention import flex_attention

    from torchtitan.models.gpt_oss import attention as attn

    monkeypatch.setattr(attn, "_compiled_flex", lambda: flex_attention)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 32, 16, generator=gen) for _ in range(3))
    sinks = torch.randn(4, generator=gen)
    doc_ids = (torch.arange(32) >= 20).long().expand(2, 32).contiguous()
    for docs in (None, doc_ids):
        pos = torch.arange(32)
        want = attn.eager_sink_attention(q, k, v, sinks, attn.allowed_keys(pos, pos, window, docs))
        got = attn.flex_sink_attention(q, k, v, sinks, window, docs)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
