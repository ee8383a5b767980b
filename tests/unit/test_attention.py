"""Block-causal (document) attention: the mask definition, the exact CPU kernel, and the model
on a packed window against its documents run alone (docs/attention.md)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.script_loader import load
from torchtitan.data.dataloader import document_ids
from torchtitan.models.common.attention import (
    AttentionCore,
    AttentionMask,
    dense_mask,
    document_causal_mask_mod,
    document_positions,
    resolve_attn_backend,
)
from torchtitan.models.llama3.args import ModelArgs
from torchtitan.models.llama3.model import Transformer

EOS = 7


def _doc_ids(lengths: list[list[int]]) -> torch.Tensor:
    return torch.tensor([[d for d, n in enumerate(row) for _ in range(n)] for row in lengths])


def test_document_ids_count_eos_tokens() -> None:
    inputs = torch.tensor([[1, 2, EOS, 3, EOS, EOS, 4], [EOS, 1, 1, 1, 1, 1, 1]])
    got = document_ids(inputs, EOS)
    assert got.dtype == torch.int32
    assert got.tolist() == [[0, 0, 0, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1, 1]]


def test_document_positions_restart_at_each_document() -> None:
    ids = _doc_ids([[3, 1, 4], [8]])
    assert document_positions(ids).tolist() == [
        [0, 1, 2, 0, 0, 1, 2, 3],
        [0, 1, 2, 3, 4, 5, 6, 7],
    ]


def test_mask_definition_equals_brute_force() -> None:
    ids = _doc_ids([[5, 1, 6], [12], [2, 2, 2, 2, 2, 2]])
    dense = dense_mask(document_causal_mask_mod(ids), 3, torch.arange(12), torch.arange(12))
    assert dense.shape == (3, 1, 12, 12) and dense.dtype == torch.bool
    for b in range(3):
        for q in range(12):
            for k in range(12):
                want = k <= q and bool(ids[b, q] == ids[b, k])
                assert bool(dense[b, 0, q, k]) == want, (b, q, k)
    # At given (global) positions: rows 8..11 over keys 0..11, as context parallel uses it.
    part = AttentionMask(ids).dense(torch.arange(8, 12), torch.arange(12))
    assert torch.equal(part, dense[:, :, 8:12])


def _naive(q, k, v, ids):  # type: ignore[no-untyped-def]
    """Softmax attention with the mask written out by loops."""
    batch, _, seq, dh = q.shape
    allowed = torch.zeros(batch, 1, seq, seq, dtype=torch.bool)
    for b in range(batch):
        for i in range(seq):
            for j in range(i + 1):
                allowed[b, 0, i, j] = bool(ids[b, i] == ids[b, j])
    scores = (q @ k.transpose(-1, -2)) / dh**0.5
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v


def test_cpu_kernel_matches_naive_attention_with_gradients() -> None:
    torch.manual_seed(0)
    ids = _doc_ids([[4, 9, 3], [16]])
    shape = (2, 3, 16, 8)
    q, k, v = (torch.randn(shape, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = AttentionCore()(q, k, v, AttentionMask(ids))
    ref = _naive(q, k, v, ids)
    assert (out - ref).abs().max().item() < 1e-12
    g = torch.randn(shape, dtype=torch.float64)
    grads = torch.autograd.grad(out, (q, k, v), g)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    for a, b in zip(grads, ref_grads):
        assert (a - b).abs().max().item() < 1e-12
    # One document spanning the window is plain causal attention.
    causal = AttentionCore()(q, k, v)
    whole = AttentionCore()(q, k, v, AttentionMask(torch.zeros(2, 16, dtype=torch.int32)))
    assert (causal - whole).abs().max().item() < 1e-12


def _tiny_model() -> Transformer:
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, max_seq_len=64)
    model = Transformer(args)
    model.init_weights(seed=3)
    return model.eval()


@pytest.mark.parametrize("per_document_positions", [False, True])
def test_packed_window_equals_documents_run_alone(per_document_positions: bool) -> None:
    """Documents A (19 tokens) and B (29 tokens) packed in one window give the logits and
    per-token losses of A and B run separately (fp32, max abs difference <= 1e-5)."""
    torch.manual_seed(1)
    model = _tiny_model()
    a, b = torch.randint(0, 97, (1, 19)), torch.randint(0, 97, (1, 29))
    packed = torch.cat([a, b], dim=1)
    ids = _doc_ids([[19, 29]])
    positions = document_positions(ids) if per_document_positions else None
    labels_a, labels_b = torch.randint(0, 97, (1, 19)), torch.randint(0, 97, (1, 29))
    with torch.no_grad():
        got = model(packed, positions=positions, doc_ids=ids)
        alone = torch.cat([model(a), model(b)], dim=1)
        causal = model(packed)
    diff = (got - alone).abs().max().item()
    print(f"per_document_positions={per_document_positions}: max |logit diff| {diff:.2e}")
    assert diff <= 1e-5
    # Plain causal attention lets B see A: far from B alone.
    assert (causal[:, 19:] - alone[:, 19:]).abs().max().item() > 1e-2
    labels = torch.cat([labels_a, labels_b], dim=1)
    loss = F.cross_entropy(got[0], labels[0], reduction="none")
    ref = F.cross_entropy(alone[0], labels[0], reduction="none")
    assert (loss - ref).abs().max().item() <= 1e-5


def test_auto_backend() -> None:
    assert resolve_attn_backend("auto", "cuda", cp_enabled=False) == "flex"
    assert resolve_attn_backend("auto", "cuda", cp_enabled=True) == "sdpa"
    assert resolve_attn_backend("auto", "cpu", cp_enabled=False) == "sdpa"
    assert resolve_attn_backend("sdpa", "cuda", cp_enabled=False) == "sdpa"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention backward needs CUDA")
def test_flex_matches_dense_on_cuda() -> None:
    from torchtitan.models.common.attention import build_attention_mask

    torch.manual_seed(0)
    ids = _doc_ids([[100, 300, 112], [512]]).cuda()
    q, k, v = (torch.randn(2, 4, 512, 64, device="cuda", requires_grad=True) for _ in range(3))
    flex = AttentionCore()(q, k, v, build_attention_mask(ids, "flex"))
    dense = AttentionCore()(q, k, v, build_attention_mask(ids, "sdpa"))
    assert (flex - dense).abs().max().item() < 1e-4
    flex.sum().backward()


def test_validation_refuses_what_cannot_work() -> None:
    import tests.toy_model  # noqa: F401  (registers "toy")
    from tests.parity import DEBUG_TOML
    from torchtitan.config import ConfigError, parse_args
    from torchtitan.preflight.validate_features import validate_attention

    def error(*argv: str, cp: int = 1) -> ConfigError:
        cfg = parse_args(["--job.config_file", DEBUG_TOML, *argv])
        with pytest.raises(ConfigError) as e:
            validate_attention(cfg, cp)
        return e.value

    block = ("--model.attn_mask_type", "block_causal")
    ring = ("--parallelism.context_parallel_method", "ring")
    e = error(*block, *ring, "--parallelism.context_parallel_rotate_method", "alltoall", cp=2)
    assert e.field == "parallelism.context_parallel_rotate_method" and "our document ring" in e.rule
    assert error(*block, "--model.name", "toy", "--model.flavor", "tiny").field == (
        "model.attn_mask_type"
    )
    assert error("--training.document_positions").field == "training.document_positions"
    if not torch.cuda.is_available():
        assert "CUDA" in error(*block, "--model.attn_backend", "flex").rule
    # What works passes: block_causal + all-gather CP, per-document positions.
    cfg = parse_args(["--job.config_file", DEBUG_TOML, *block, "--training.document_positions"])
    validate_attention(cfg, 2)


def test_attention_benchmark_runs_tiny() -> None:
    bench = load("benchmarks/attention_mask.py", "attention_mask_bench")
    argv = ["--seq_len", "128", "--heads", "2", "--min_doc", "20", "--max_doc", "50"]
    result = bench.main([*argv, "--iters", "1", "--warmup", "0"])
    assert result["documents"] >= 3
    assert result["sdpa_causal_ms"] > 0 and result["sdpa_block_causal_ms"] > 0
