"""The steps the Hugging Face generation tests of the families share: a tiny random model with
weights large enough for a varied greedy continuation, written as a Hugging Face folder, then
its greedy tokens checked against the cache-free recomputation, ``scripts/generate.py --hf``
reading the folder back, and transformers' own ``generate``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.hf_parity import export_hf
from tests.script_loader import load
from torchtitan.data.tokenizer import build_tokenizer

TOKENIZER = "tests/assets/hf_tokenizer"
PROMPT = "Once upon a time"
NEW_TOKENS = 12

gen = load("scripts/generate.py", "generate")


def varied(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` initialized (seed 5), then its weights drawn larger than the init (a varied
    greedy continuation), in eval mode."""
    model.init_weights(seed=5)  # type: ignore[operator]
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model.eval()


def check_hf_generation(
    model: torch.nn.Module, adapter: Any, folder: Path, capsys: pytest.CaptureFixture[str]
) -> torch.Tensor:
    """Writes ``model`` through ``adapter`` to ``folder`` and checks its greedy tokens (with the
    cache, without, read back by ``generate.py --hf``, by transformers); returns the prompt."""
    transformers = pytest.importorskip("transformers")
    export_hf(model, adapter, folder)

    ids = build_tokenizer(TOKENIZER).encode(PROMPT, bos=True, eos=False)
    prompt = torch.tensor([ids])
    ours = gen.generate(model, prompt, NEW_TOKENS)
    assert len(set(ours[0, len(ids) :].tolist())) > 3, ours  # not a constant continuation
    assert torch.equal(ours, gen.generate(model, prompt, NEW_TOKENS, use_cache=False))

    argv = [str(folder), "--hf", "--tokenizer", TOKENIZER, "--prompt", PROMPT]
    assert gen.main([*argv, "--max_new_tokens", str(NEW_TOKENS), "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["ids"] == ours[0, len(ids) :].tolist()

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    theirs = hf.eval().generate(
        prompt, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS
    )
    print(f"{type(hf).__name__}: ours {out['ids']} theirs {theirs[0, len(ids) :].tolist()}")
    assert torch.equal(theirs, ours)
    return prompt
