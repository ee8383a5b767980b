"""The SFT loss: prompt tokens get exactly zero gradient; the global token normalisation."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from torchtitan.data.chat_data import ChatDataset
from torchtitan.data.tokenizer import build_tokenizer
from torchtitan.loss.cross_entropy import (
    IGNORE_INDEX,
    cross_entropy_loss,
    cross_entropy_sum,
    global_loss_scale,
    unmasked_tokens,
)
from torchtitan.models.llama3.args import ModelArgs
from torchtitan.models.llama3.model import Transformer

TRAIN = Path(__file__).resolve().parents[2] / "tests" / "assets" / "chat" / "train.jsonl"


def test_prompt_tokens_get_zero_gradient() -> None:
    tok = build_tokenizer("tests/assets/tokenizer")
    ds = ChatDataset(TRAIN, tok, 64, packing="pack", with_doc_ids=True)
    it = iter(ds)
    batch = [next(it) for _ in range(2)]
    inputs, labels, doc_ids = (torch.stack(t) for t in zip(*batch))
    prompt = labels == IGNORE_INDEX
    assert prompt.any() and (~prompt).any()
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=tok.vocab_size)
    model = Transformer(args)
    model.init_weights(seed=3)

    logits = model(inputs, doc_ids=doc_ids)
    logits.retain_grad()
    tokens = unmasked_tokens([labels], None)
    assert tokens == int((~prompt).sum())
    loss = cross_entropy_sum(logits, labels) * global_loss_scale(tokens, 1)
    loss.backward()
    assert logits.grad is not None
    per_token = logits.grad.abs().sum(-1)
    assert torch.all(per_token[prompt] == 0)  # exactly zero at every prompt/padding position
    assert torch.all(per_token[~prompt] > 0)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    # The same gradients as the mean loss over the assistant tokens picked out by hand.
    model.zero_grad()
    logp = F.log_softmax(model(inputs, doc_ids=doc_ids).float(), dim=-1)
    manual = -logp[~prompt].gather(-1, labels[~prompt].unsqueeze(-1)).mean()
    manual.backward()
    assert torch.allclose(loss, manual, rtol=1e-6)
    for n, p in model.named_parameters():
        assert p.grad is not None
        assert torch.allclose(grads[n], p.grad, rtol=1e-4, atol=1e-7), n


def test_global_scale_is_the_mean_without_masked_labels() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 8, 11)
    labels = torch.randint(0, 11, (2, 8))
    summed = cross_entropy_sum(logits, labels) * global_loss_scale(16, 1)
    assert torch.allclose(summed, cross_entropy_loss(logits, labels), rtol=1e-6)
    # one rank of 4 averaging ranks holding 16 of 64 global tokens: x4/64 = its share of the mean
    assert global_loss_scale(64, 4) == 4 / 64
    assert global_loss_scale(0, 4) == 0.0  # a step without trained tokens trains nothing
