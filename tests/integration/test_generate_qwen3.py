"""Generation for Qwen3 dense and Qwen3-MoE: a random tiny model exported to a Hugging Face folder
is read back by ``scripts/generate.py --hf`` (the family from ``config.json``) and gives the same
greedy tokens as our model in memory, as the KV-cache-free recomputation, and as transformers'
own greedy ``generate`` (``tests/hf_generate.py``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from tests.hf_generate import check_hf_generation, varied
from tests.tiny_args import tiny_qwen3
from torchtitan.models.common.hf import StateDictAdapter
from torchtitan.models.common.moe import MoEArgs
from torchtitan.models.qwen3 import Qwen3Args, Transformer
from torchtitan.models.qwen3.hf import QWEN3_HF

pytest.importorskip("transformers")

DENSE = tiny_qwen3(vocab=1024)
MOE = dataclasses.replace(
    DENSE, tie_word_embeddings=False, moe=MoEArgs(num_experts=4, top_k=2, expert_dim=32)
)


@pytest.mark.parametrize("args", [DENSE, MOE], ids=["dense", "moe"])
def test_generate_from_hf_folder(
    args: Qwen3Args, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.manual_seed(0)
    model = varied(Transformer(args))
    check_hf_generation(model, StateDictAdapter(QWEN3_HF, args), tmp_path, capsys)
