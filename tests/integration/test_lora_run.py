"""The documented LoRA path (docs/lora.md): a Hugging Face base -> LoRA chat SFT with
``train_configs/lora_debug.toml`` -> ``scripts/export_lora.py`` -> ``peft.PeftModel`` on
transformers gives the same greedy tokens as our own generation of the trained model; the
merged export too; the exported adapters start a new run (``lora.adapter_path``) exactly where
the first one ended; the loss falls."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import torchtitan.train  # noqa: F401  (imported before the ranks fork)
from tests.launcher import run_ranks
from tests.parity import ROOT, SMALL_FP32, read_jsonl
from tests.script_loader import load
from torchtitan.checkpoint.storage import read_model_weights
from torchtitan.checkpoint.trust import decode_state
from torchtitan.config.manager import parse_args
from torchtitan.data.tokenizer import build_tokenizer
from torchtitan.lora.apply import apply_lora
from torchtitan.models import MODELS
from torchtitan.models.spec import runtime_args

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

TOML = ["--job.config_file", str(ROOT / "train_configs" / "lora_debug.toml")]
# Short rows of one conversation pair, fp32, every step logged, a one-step warm-up.
SHORT = [*SMALL_FP32, "--validation.no-enable", "--lr_scheduler.warmup_steps", "1"]


def _train(argv: list[str]) -> int:
    from torchtitan.train import main

    return main(argv)


def _hf_base(folder: Path) -> tuple[object, dict[str, torch.Tensor]]:
    from safetensors.torch import save_file

    cfg = parse_args(TOML)
    spec = MODELS["llama3"]
    vocab = build_tokenizer(str(ROOT / cfg.model.tokenizer_path)).vocab_size
    args = runtime_args(spec, cfg.model.flavor, vocab, 64)
    model = spec.build(args)
    model.init_weights(seed=11)
    adapter = spec.state_dict_adapter(args)
    folder.mkdir()
    save_file(adapter.to_hf(dict(model.state_dict())), str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(adapter.hf_config()))
    return args, dict(model.state_dict())


def _ours(args: object, base: dict, adapters: dict) -> torch.nn.Module:
    spec = MODELS["llama3"]
    model = spec.build(args)
    apply_lora(model, parse_args(TOML).lora)
    model.load_state_dict({**base, **adapters})
    model.init_buffers()
    return model.eval()


@pytest.mark.slow
def test_hf_base_lora_sft_peft_generation(tmp_path: Path) -> None:
    args, base_sd = _hf_base(tmp_path / "base")
    dump = tmp_path / "run"
    argv = [*TOML, *SHORT, "--job.dump_folder", str(dump), "--training.steps", "6"]
    argv += ["--checkpoint.interval", "6", "--checkpoint.initial_load_path", str(tmp_path / "base")]
    argv += ["--checkpoint.initial_load_in_hf"]
    assert run_ranks(_train, 1, argv) == [0]
    loss = [m["loss"] for m in read_jsonl(dump / "metrics" / "rank_0.jsonl")]
    print(f"LoRA SFT from an HF base: loss {loss[0]:.3f} -> {loss[-1]:.3f}")
    assert loss[-1] < loss[0]

    ckpt = dump / "checkpoint" / "step-6"
    adapters = read_model_weights(ckpt)
    export = load("scripts/export_lora.py")
    export.export(ckpt, tmp_path / "base", tmp_path / "peft", TOML, merged=False)
    export.export(ckpt, tmp_path / "base", tmp_path / "merged", TOML, merged=True)

    gen = load("scripts/generate.py")
    prompt = torch.randint(0, 500, (2, 8), generator=torch.Generator().manual_seed(3))
    ours = gen.generate(_ours(args, base_sd, adapters), prompt, 12)[:, 8:]
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    theirs = peft.PeftModel.from_pretrained(hf, tmp_path / "peft").eval()
    kw = dict(max_new_tokens=12, do_sample=False, min_new_tokens=12)
    peft_tokens = theirs.generate(input_ids=prompt, **kw)[:, 8:]
    merged = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    merged_tokens = merged.generate(input_ids=prompt, **kw)[:, 8:]
    print(f"greedy tokens ours {ours[0].tolist()} peft {peft_tokens[0].tolist()}")
    assert torch.equal(ours, peft_tokens) and torch.equal(ours, merged_tokens)

    # PEFT adapters in: a new run starts from them (its first loss is the first run's next).
    dump2 = tmp_path / "run2"
    argv2 = [*TOML, *SHORT, "--job.dump_folder", str(dump2), "--training.steps", "1"]
    argv2 += ["--lora.adapter_path", str(tmp_path / "peft")]
    argv2 += ["--checkpoint.initial_load_path", str(tmp_path / "base")]
    argv2 += ["--checkpoint.initial_load_in_hf"]
    assert run_ranks(_train, 1, argv2) == [0]
    first = read_jsonl(dump2 / "metrics" / "rank_0.jsonl")[0]["loss"]
    print(f"run from the PEFT adapters: first loss {first:.4f} (first run's last {loss[-1]:.4f})")
    assert first < loss[0] - 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("base", ["plain", "nf4"])
def test_lora_resume_is_bitwise_and_names_the_base(base: str, tmp_path: Path) -> None:
    """LoRA (and QLoRA: the HF base quantized to NF4 after the load, sharded by FSDP 2)."""
    from tests.checkpoint_helpers import assert_checkpoints_identical, read_checkpoint

    _hf_base(tmp_path / "base")
    common = [*TOML, *SHORT, "--training.steps", "4", "--checkpoint.interval", "2"]
    common += ["--checkpoint.initial_load_path", str(tmp_path / "base")]
    common += ["--checkpoint.initial_load_in_hf", "--parallelism.data_parallel_shard_degree", "2"]
    common += ["--lora.quantize_base", "nf4"] if base == "nf4" else []
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert run_ranks(_train, 2, [*common, "--job.dump_folder", str(straight)]) == [0, 0]
    # The same run stopped after step 2: its folder without step-4, resumed (base from HF,
    # adapters, optimizer, schedule, data and RNG from step-2).
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "metrics")
    shutil.move(resumed / "checkpoint/step-4", tmp_path / "straight-step-4")
    assert run_ranks(_train, 2, [*common, "--job.dump_folder", str(resumed)]) == [0, 0]
    straight = tmp_path / "straight-step-4"
    n = assert_checkpoints_identical(straight, resumed / "checkpoint/step-4")
    model = read_model_weights(straight)
    assert model and all(".lora_" in k for k in model)
    state = decode_state(read_checkpoint(straight)["train_state"])
    assert state["settings"]["model"]["checkpoint.initial_load_path"] == str(tmp_path / "base")
    print(f"LoRA ({base}) FSDP 2 resume: {n} entries bitwise equal, {len(model)} adapter tensors")
