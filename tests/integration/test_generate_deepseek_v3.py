"""Generation for DeepSeek-V3 with MLA's latent cache: greedy tokens with the cache equal the
cache-free recomputation; the cache holds per token the key/value latent and the rotated key
only; a random tiny model exported to a Hugging Face folder is read back by
``scripts/generate.py --hf`` and gives the same tokens, as does transformers' greedy
``generate`` (``tests/hf_generate.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.hf_generate import check_hf_generation, varied
from tests.tiny_args import tiny_deepseek_v3
from torchtitan.models.common.kv_cache import KVCache
from torchtitan.models.deepseek_v3 import Transformer
from torchtitan.models.deepseek_v3.hf import DEEPSEEK_V3_HF, DeepSeekV3Adapter

pytest.importorskip("transformers")


def test_latent_cache_generation(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = tiny_deepseek_v3(vocab_size=1024, mtp_depth=1)
    model = varied(Transformer(args))
    prompt = check_hf_generation(model, DeepSeekV3Adapter(DEEPSEEK_V3_HF, args), tmp_path, capsys)

    cache = KVCache(32)
    with torch.no_grad():
        model(prompt, cache=cache)
    layer = cache.layers["0"]
    assert layer.k is not None and layer.v is not None
    assert layer.k.shape == (1, 32, 1, args.kv_lora_rank)  # the latent, not H x head_dim keys
    assert layer.v.shape == (1, 32, 1, args.qk_rope_head_dim)  # the rotated key
