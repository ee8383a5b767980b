"""Generation for DeepSeek-V3 with MLA's latent cache: greedy tokens with the cache equal the
cache-free recomputation; the cache holds per token the key/value latent and the rotated key
only; a random tiny model exported to a Hugging Face folder is read back by
``scripts/generate.py --hf`` and gives the same tokens, as does transformers' greedy
``generate``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.script_loader import load
from tests.tiny_args import tiny_deepseek_v3
from torchtitan.data.tokenizer import build_tokenizer
from torchtitan.models.common.kv_cache import KVCache
from torchtitan.models.deepseek_v3 import Transformer
from torchtitan.models.deepseek_v3.hf import DEEPSEEK_V3_HF, DeepSeekV3Adapter

transformers = pytest.importorskip("transformers")
TOKENIZER = "tests/assets/hf_tokenizer"
PROMPT = "Once upon a time"
NEW_TOKENS = 12

gen = load("scripts/generate.py", "generate")


def test_latent_cache_generation(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from safetensors.torch import save_file

    args = tiny_deepseek_v3(vocab_size=1024, mtp_depth=1)
    model = Transformer(args)
    model.init_weights(seed=5)
    with torch.no_grad():  # larger weights than the init: a varied greedy continuation
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    model.eval()
    ids = build_tokenizer(TOKENIZER).encode(PROMPT, bos=True, eos=False)
    prompt = torch.tensor([ids])
    ours = gen.generate(model, prompt, NEW_TOKENS)
    assert len(set(ours[0, len(ids) :].tolist())) > 3, ours  # not a constant continuation
    assert torch.equal(ours, gen.generate(model, prompt, NEW_TOKENS, use_cache=False))

    cache = KVCache(32)
    with torch.no_grad():
        model(prompt, cache=cache)
    layer = cache.layers["0"]
    assert layer.k is not None and layer.v is not None
    assert layer.k.shape == (1, 32, 1, args.kv_lora_rank)  # the latent, not H x head_dim keys
    assert layer.v.shape == (1, 32, 1, args.qk_rope_head_dim)  # the rotated key

    adapter = DeepSeekV3Adapter(DEEPSEEK_V3_HF, args)
    save_file(adapter.to_hf(dict(model.state_dict())), str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(adapter.hf_config()))
    argv = [str(tmp_path), "--hf", "--tokenizer", TOKENIZER, "--prompt", PROMPT]
    assert gen.main([*argv, "--max_new_tokens", str(NEW_TOKENS), "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["ids"] == ours[0, len(ids) :].tolist()

    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    theirs = hf.eval().generate(
        prompt, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS
    )
    print(f"{type(hf).__name__}: ours {out['ids']} theirs {theirs[0, len(ids) :].tolist()}")
    assert torch.equal(theirs, ours)
