"""What the post-training tests share (docs/posttrain.md): a byte-level tokenizer and a tiny Llama."""

from __future__ import annotations

import torch

from tests.tiny_args import tiny_llama3
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


def text_length(completion: str, answer: str | None) -> float:
    """A user reward by import path (``tests.posttrain_helpers:text_length``) that varies
    within a group even for an untrained model: the decoded completion's length."""
    return float(len(completion))
