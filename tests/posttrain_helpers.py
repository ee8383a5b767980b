"""What the post-training tests share (docs/posttrain.md): a byte-level tokenizer, a tiny Llama,
and the SFT warm-up of the learning tests."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.tiny_args import tiny_llama3
from torchtitan.data.chat_data import tokenized_conversations
from torchtitan.loss.cross_entropy import IGNORE_INDEX, cross_entropy_loss
from torchtitan.models import MODELS


class CharTokenizer:
    """Bytes as ids (vocab 256, EOS 0, no BOS): enough for the chat template and decoding."""

    bos_id = None
    eos_id = 0

    def encode(self, text: str, bos: bool = True, eos: bool = True) -> list[int]:
        return [b or 1 for b in text.encode()]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 < i < 256).decode(errors="replace")


def tiny_model(seed: int = 0, dim: int = 32, layers: int = 2) -> torch.nn.Module:
    args = tiny_llama3(dim=dim, heads=(2, 1), vocab=256, max_seq_len=64, n_layers=layers)
    m = MODELS["llama3"].build(args)
    m.init_weights(seed)
    return m


def sft(model: torch.nn.Module, path: Path, steps: int, lr: float = 3e-3, batch: int = 16) -> float:
    """Plain SFT on the chat file ``path`` (prompt-masked labels, docs/sft.md); the last loss."""
    convs, _ = tokenized_conversations(path, CharTokenizer(), 48, "truncate", "default")
    width = max(len(x) for x, _ in convs)
    x = torch.zeros(len(convs), width, dtype=torch.long)
    y = torch.full((len(convs), width), IGNORE_INDEX, dtype=torch.long)
    for i, (a, b) in enumerate(convs):
        x[i, : len(a)], y[i, : len(b)] = torch.from_numpy(a), torch.from_numpy(b)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(0)
    loss = torch.zeros(())
    for _ in range(steps):
        idx = torch.randint(0, len(convs), (batch,), generator=g)
        loss = cross_entropy_loss(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return float(loss)
