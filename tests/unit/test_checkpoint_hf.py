"""Hugging Face interop: our checkpoint -> HF safetensors loads in transformers with the same
logits (fp32, max abs diff <= 1e-4); HF -> ours -> HF is bit-identical."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.script_loader import load
from tests.tiny_args import tiny_llama3
from torchtitan.checkpoint.storage import (
    read_hf_folder,
    read_model_weights,
    write_model_weights,
)
from torchtitan.models.common.hf import StateDictAdapter
from torchtitan.models.common.rope import Llama3Scaling
from torchtitan.models.llama3.hf import LLAMA3_HF, args_from_hf_config
from torchtitan.models.llama3.model import Transformer

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]


# GQA (8 query heads, 4 kv heads) and Llama 3.1 RoPE scaling, to exercise every conversion.
ARGS = tiny_llama3(multiple_of=64, rope_scaling=Llama3Scaling(8.0, original_max_seq_len=32))


def test_rope_permutation_round_trips() -> None:
    adapter = StateDictAdapter(LLAMA3_HF, ARGS)
    sd = {"layers.0.attention.wq.weight": torch.randn(128, 128)}
    sd["layers.0.attention.wk.weight"] = torch.randn(64, 128)
    back = adapter.from_hf(adapter.to_hf(sd))
    assert all(torch.equal(back[k], sd[k]) for k in sd)
    hf = adapter.to_hf(sd)["model.layers.0.self_attn.q_proj.weight"]
    # head 0: HF's first half are our even rows, the second half our odd rows
    assert torch.equal(hf[:8], sd["layers.0.attention.wq.weight"][0:16:2])
    assert torch.equal(hf[8:16], sd["layers.0.attention.wq.weight"][1:16:2])


def test_export_matches_transformers_logits(tmp_path: Path) -> None:
    model = Transformer(ARGS)
    model.init_weights(seed=3)  # type: ignore[operator]
    model.eval()
    write_model_weights(tmp_path / "ckpt", 7, dict(model.state_dict()))
    hf_dir = tmp_path / "hf"
    load("scripts/convert_to_hf.py").convert(
        tmp_path / "ckpt" / "step-7", hf_dir, ARGS, torch.float32, shard_mb=1
    )
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1, "expected several shards at 1 MiB"
    hf_model = transformers.LlamaForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    tokens = torch.randint(0, ARGS.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(tokens)
        theirs = hf_model(tokens).logits
    diff = (ours - theirs).abs().max().item()
    print(f"ours vs transformers LlamaForCausalLM: max abs logit diff {diff:.2e}")
    assert diff <= 1e-4, diff


def test_hf_to_ours_to_hf_is_bit_identical(tmp_path: Path) -> None:
    config = transformers.LlamaConfig(**StateDictAdapter(LLAMA3_HF, ARGS).hf_config())
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf_in")
    original = read_hf_folder(tmp_path / "hf_in")[1]

    assert (
        load("scripts/convert_from_hf.py").main([str(tmp_path / "hf_in"), str(tmp_path / "ck")])
        == 0
    )
    ours = read_model_weights(tmp_path / "ck" / "step-0")
    model = Transformer(ARGS)
    model.load_state_dict(ours)  # our names and shapes, nothing missing

    config_in = json.loads((tmp_path / "hf_in" / "config.json").read_text())
    got_args = args_from_hf_config(config_in)
    assert (got_args.rope_theta, got_args.rope_scaling) == (500000.0, ARGS.rope_scaling), got_args
    assert got_args.hidden_dim == ARGS.hidden_dim and got_args.kv_heads == 4
    load("scripts/convert_to_hf.py").convert(
        tmp_path / "ck" / "step-0",
        tmp_path / "hf_out",
        args_from_hf_config(config_in),
        torch.float32,
        shard_mb=4096,
    )
    back = read_hf_folder(tmp_path / "hf_out")[1]
    assert set(back) == set(original)
    for k in original:
        assert back[k].dtype == original[k].dtype and torch.equal(back[k], original[k]), k
