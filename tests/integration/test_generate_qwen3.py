"""Generation for Qwen3 dense and Qwen3-MoE: a random tiny model exported to a Hugging Face folder
is read back by ``scripts/generate.py --hf`` (the family from ``config.json``) and gives the same
greedy tokens as our model in memory, as the KV-cache-free recomputation, and as transformers'
own greedy ``generate``."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from tests.script_loader import load
from tests.tiny_args import tiny_qwen3
from torchtitan.data.tokenizer import build_tokenizer
from torchtitan.models.common.hf import StateDictAdapter
from torchtitan.models.common.moe import MoEArgs
from torchtitan.models.qwen3 import Qwen3Args, Transformer
from torchtitan.models.qwen3.hf import QWEN3_HF

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = "tests/assets/hf_tokenizer"
PROMPT = "Once upon a time"
NEW_TOKENS = 12

gen = load("scripts/generate.py", "generate")

DENSE = tiny_qwen3(vocab=1024)
MOE = dataclasses.replace(
    DENSE, tie_word_embeddings=False, moe=MoEArgs(num_experts=4, top_k=2, expert_dim=32)
)


@pytest.mark.parametrize("args", [DENSE, MOE], ids=["dense", "moe"])
def test_generate_from_hf_folder(
    args: Qwen3Args, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights(seed=5)
    with torch.no_grad():  # larger weights than the init: a varied greedy continuation
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    model.eval()
    adapter = StateDictAdapter(QWEN3_HF, args)
    save_file(adapter.to_hf(dict(model.state_dict())), str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(adapter.hf_config()))

    ids = build_tokenizer(TOKENIZER).encode(PROMPT, bos=True, eos=False)
    prompt = torch.tensor([ids])
    ours = gen.generate(model, prompt, NEW_TOKENS)
    assert len(set(ours[0, len(ids) :].tolist())) > 3, ours  # not a constant continuation
    assert torch.equal(ours, gen.generate(model, prompt, NEW_TOKENS, use_cache=False))

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
