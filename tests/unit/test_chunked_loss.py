"""Chunked linear + cross-entropy equals the whole-logits loss (values and gradients) and keeps
the loss's peak activation memory several times lower at a 128k vocabulary (docs/memory.md)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.distributed.output_head import DeferredLinear, defer_output
from torchtitan.loss.chunked import chunked_cross_entropy
from torchtitan.planner.tracker import LiveTensorTracker


def _inputs(tokens: int, dim: int, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, tokens // 2, dim, generator=g, requires_grad=True)
    weight = (torch.randn(vocab, dim, generator=g) * dim**-0.5).requires_grad_()
    labels = torch.randint(0, vocab, (2, tokens // 2), generator=g)
    labels[0, :7] = -100  # prompt-masked tokens
    labels[1, -3:] = -100
    return hidden, weight, labels


def _reference(hidden, weight, labels, reduction):
    logits = F.linear(hidden, weight)
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction=reduction)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk", [16, 37, 1000])
def test_same_loss_and_grads(reduction: str, chunk: int) -> None:
    hidden, weight, labels = _inputs(96, 32, 500)
    ref = _reference(hidden, weight, labels, reduction)
    ref_gh, ref_gw = torch.autograd.grad(ref, (hidden, weight))
    got = chunked_cross_entropy(hidden, weight, labels, chunk, reduction=reduction)  # type: ignore[arg-type]
    gh, gw = torch.autograd.grad(got, (hidden, weight))
    assert abs(got.item() - ref.item()) <= 1e-6 * abs(ref.item())
    for a, b in ((gh, ref_gh), (gw, ref_gw)):
        assert (a - b).norm() <= 1e-6 * b.norm(), (a - b).norm() / b.norm()


def test_all_ignored_is_nan_like_torch() -> None:
    hidden, weight, labels = _inputs(8, 4, 10)
    labels.fill_(-100)
    assert torch.isnan(chunked_cross_entropy(hidden, weight, labels, 3))
    assert torch.isnan(_reference(hidden, weight, labels, "mean"))


def test_defer_output_keeps_the_weight_and_returns_input() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 9, bias=False))
    weight = model[1].weight
    head = defer_output(model, "1")
    assert isinstance(head, DeferredLinear) and head.weight is weight
    assert list(model.state_dict()) == ["0.weight", "0.bias", "1.weight"]
    x = torch.randn(2, 4)
    assert torch.equal(model(x), model[0](x))
    with pytest.raises(TypeError, match="bias-free nn.Linear"):
        defer_output(nn.Sequential(nn.Linear(4, 9)), "0")


def _loss_peak(chunk: int, tokens: int, dim: int, vocab: int) -> int:
    hidden, weight, labels = _inputs(tokens, dim, vocab)
    with LiveTensorTracker() as tracker:
        tracker.add([hidden, weight, labels])
        tracker.reset_peak()
        base = tracker.current
        if chunk:
            loss = chunked_cross_entropy(hidden, weight, labels, chunk)
        else:
            loss = _reference(hidden, weight, labels, "mean")
        loss.backward()
        del loss
        # Gradients of the inputs are the same whatever the chunking: count the loss's own memory.
        grads = (hidden.numel() + weight.numel()) * 4
    return tracker.peak - base - grads


def test_peak_loss_memory_at_128k_vocab_is_4x_lower() -> None:
    tokens, dim, vocab = 256, 32, 128_256
    whole = _loss_peak(0, tokens, dim, vocab)
    chunked = _loss_peak(32, tokens, dim, vocab)
    print(
        f"loss peak at vocab {vocab}, {tokens} tokens: whole {whole / 2**20:.1f} MiB, "
        f"chunks of 32 {chunked / 2**20:.1f} MiB ({whole / chunked:.1f}x)"
    )
    assert whole >= 2 * tokens * vocab * 4  # at least the logits and their log-softmax
    assert whole >= 4 * chunked


@pytest.mark.parametrize(
    "argv, field",
    [
        (["--training.loss_chunk_size", "-1"], "training.loss_chunk_size"),
        (["--training.loss_chunk_size", "64", "--compile.enable"], "compile.components"),
        (
            [
                "--training.loss_chunk_size=64",
                "--quantize.dense.float8.enable",
                "--quantize.dense.float8.emulate",
                "--quantize.dense.float8.filter_fqns=layers.0",
            ],
            "quantize.dense.float8.filter_fqns",
        ),
    ],
)
def test_preflight_refuses(argv: list[str], field: str) -> None:
    from torchtitan.config.errors import ConfigError
    from torchtitan.preflight.validate import load_config

    with pytest.raises(ConfigError) as err:
        load_config(["--job.config_file", "train_configs/debug_model.toml", *argv], world_size=1)
    assert err.value.field == field


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_build_chunked_loss_reads_the_deferred_weight(reduction: str) -> None:
    from torchtitan.loss.chunked import build_chunked_loss

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 50, bias=False))
    hidden, _, labels = _inputs(20, 8, 50)
    ref = F.cross_entropy(model(hidden).flatten(0, 1), labels.flatten(), reduction=reduction)
    defer_output(model, "1")
    loss_fn = build_chunked_loss([model], "1", 6, gather_logits=False, reduction=reduction)  # type: ignore[arg-type]
    got = loss_fn(model(hidden), labels)
    assert torch.allclose(got, ref, rtol=1e-6)
