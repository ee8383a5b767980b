"""The bad weight folders of docs/errors.md "Weight folders": (id, entry point, argv, words).

:func:`make_weight_folders` writes, into one folder, a llama3 ``debugmodel`` checkpoint and
its Hugging Face export and each damaged or mismatched variant the cases name (``{d}`` in an
argument). Entry points: ``convert`` (``python -m torchtitan.convert``), ``eval`` (``python -m
torchtitan.eval``, after ``EVAL``) and ``train`` (the training preflight, after ``TRAIN``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ["--job.config_file", str(ROOT / "train_configs" / "debug_model.toml")]
EVAL = [*TRAIN, "--eval.tasks", "torchtitan_facts_mc"]
HF = "--checkpoint.initial_load_in_hf"
LORA = ["--lora.enable", "--lora.adapter_path"]


def _hf_load(folder: str) -> list[str]:
    return ["--checkpoint.initial_load_path", folder, HF]


# (id, entry point, argv, words the one line must hold)
CASES: list[tuple[str, str, list[str], str]] = [
    # python -m torchtitan.convert to-hf
    ("to-hf-missing", "convert", ["to-hf", "{d}/missing", "{d}/o1"], "does not exist"),
    ("to-hf-root", "convert", ["to-hf", "{d}/ck", "{d}/o1"], "is a checkpoint root"),
    ("to-hf-hf-folder", "convert", ["to-hf", "{d}/hf", "{d}/o1"], "is a Hugging Face folder"),
    ("to-hf-empty", "convert", ["to-hf", "{d}/empty", "{d}/o1"], "holds no .metadata"),
    ("to-hf-peft", "convert", ["to-hf", "{d}/peft_rank4", "{d}/o1"], "is a PEFT adapter folder"),
    ("to-hf-damaged", "convert", ["to-hf", "{d}/ck_damaged/step-1", "{d}/o1"], "is damaged"),
    ("to-hf-manifest", "convert", ["to-hf", "{d}/ck_manifest/step-1", "{d}/o1"],
     "is damaged: unreadable manifest (its files are not {name: {size, sha256}})"),
    ("to-hf-out-file", "convert", ["to-hf", "{d}/ck/step-1", "{d}/a_file"], "is a file"),
    ("to-hf-out-taken", "convert", ["to-hf", "{d}/ck/step-1", "{d}/hf"], "already holds"),
    ("to-hf-shard-neg", "convert", ["to-hf", "{d}/ck/step-1", "{d}/o1", "--max-shard-gb", "-1"],
     "--max-shard-gb = -1.0: must be a finite number > 0"),
    ("to-hf-shard-nan", "convert", ["to-hf", "{d}/ck/step-1", "{d}/o1", "--max-shard-gb", "nan"],
     "must be a finite number > 0"),
    ("to-hf-flavor-unknown", "convert", ["to-hf", "{d}/ck/step-1", "{d}/o1", "--flavor", "huge"],
     "is not a flavor of llama3. Fix: pick one of ['debugmodel'"),
    ("to-hf-flavor-mismatch", "convert", ["to-hf", "{d}/ck/step-1", "{d}/o1", "--flavor", "8B"],
     "is not a llama3 8B checkpoint"),
    ("to-hf-other-family", "convert", ["to-hf", "{d}/qwen_ck/step-1", "{d}/o1"],
     "another family's checkpoint fits none of them"),
    ("to-hf-lora", "convert", ["to-hf", "{d}/lora_ck/step-1", "{d}/o1"], "is a LoRA checkpoint"),
    # python -m torchtitan.convert from-hf
    ("from-hf-step-neg", "convert", ["from-hf", "{d}/hf", "{d}/o2", "--step", "-3"],
     "--step = -3: must be >= 0"),
    ("from-hf-missing", "convert", ["from-hf", "{d}/missing", "{d}/o2"], "does not exist"),
    ("from-hf-dcp", "convert", ["from-hf", "{d}/ck", "{d}/o2"], "is a DCP checkpoint"),
    ("from-hf-truncated", "convert", ["from-hf", "{d}/hf_trunc", "{d}/o2"],
     "is not a readable safetensors file"),
    ("from-hf-garbage", "convert", ["from-hf", "{d}/hf_garbage", "{d}/o2"],
     "is not a readable safetensors file"),
    ("from-hf-no-config", "convert", ["from-hf", "{d}/hf_noconfig", "{d}/o2"],
     "config.json does not exist"),
    ("from-hf-bad-json", "convert", ["from-hf", "{d}/hf_badjson", "{d}/o2"], "is not valid JSON"),
    ("from-hf-missing-key", "convert", ["from-hf", "{d}/hf_nokey", "{d}/o2"],
     "lacks the key 'hidden_size'"),
    ("from-hf-bad-value", "convert", ["from-hf", "{d}/hf_badvalue", "{d}/o2"],
     "config.json cannot be read as a llama3 config"),
    ("from-hf-no-layers", "convert", ["from-hf", "{d}/hf_nolayers", "{d}/o2"],
     "config.json has num_hidden_layers = -2: must be >= 1"),
    ("from-hf-shapes", "convert", ["from-hf", "{d}/hf_vocab", "{d}/o2"],
     "model.embed_tokens.weight is [2048, 256] in the folder, [4096, 256] in its config.json's"),
    ("from-hf-width", "convert", ["from-hf", "{d}/hf_wide", "{d}/o2"],
     "model.embed_tokens.weight is [2048, 256] in the folder, [2048, 512] in its config.json's"),
    ("from-hf-other-weights", "convert", ["from-hf", "{d}/hf_mixed", "{d}/o2"],
     "weights of another model family"),
    ("from-hf-model-mismatch", "convert", ["from-hf", "{d}/hf", "{d}/o2", "--model", "qwen3"],
     "--model = 'qwen3': {d}/hf/config.json describes a llama3 model. Fix: use --model llama3"),
    ("from-hf-unknown-arch", "convert", ["from-hf", "{d}/hf_gpt2", "{d}/o2"],
     "which no family here trains"),
    ("from-hf-flavor", "convert", ["from-hf", "{d}/hf", "{d}/o2", "--flavor", "8B"],
     "is not --flavor 8B"),
    ("from-hf-flavor-unknown", "convert", ["from-hf", "{d}/hf", "{d}/o2", "--flavor", "huge"],
     "is not a flavor of llama3"),
    ("from-hf-step-exists", "convert", ["from-hf", "{d}/hf", "{d}/ck", "--step", "1"],
     "converting would replace it"),
    ("usage", "convert", ["to-hf", "{d}/ck/step-1", "--model", "llama3", "--flavor", "8B"],
     "the following arguments are required: output"),
    # python -m torchtitan.eval
    ("eval-missing", "eval", ["--eval.checkpoint", "{d}/missing"], "does not exist"),
    ("eval-not-checkpoint", "eval", ["--eval.checkpoint", "{d}/empty"], "holds no .metadata"),
    ("eval-a-file", "eval", ["--eval.checkpoint", "{d}/a_file"], "is a file, not a folder"),
    ("eval-hf-truncated", "eval", ["--eval.checkpoint", "{d}/hf_trunc"],
     "is not a readable safetensors file"),
    ("eval-hf-no-config", "eval", ["--eval.checkpoint", "{d}/hf_noconfig"],
     "a Hugging Face folder needs its config.json"),
    ("eval-unknown-arch", "eval", ["--eval.checkpoint", "{d}/hf_gpt2"],
     "which no family here trains"),
    ("eval-other-family", "eval", ["--eval.checkpoint", "{d}/qwen_ck/step-1"],
     "is not a llama3 debugmodel checkpoint"),
    ("eval-lora", "eval", ["--eval.checkpoint", "{d}/lora_ck/step-1"], "is a LoRA checkpoint"),
    ("eval-root-invalid", "eval", ["--eval.checkpoint", "{d}/ck_damaged"],
     "holds no valid checkpoint"),
    ("eval-limit-0", "eval", ["--eval.checkpoint", "{d}/ck", "--eval.limit", "0"],
     "eval.limit = 0: must be >= 1 or -1"),
    # training: checkpoint.initial_load_path, lora.adapter_path
    ("train-hf-truncated", "train", _hf_load("{d}/hf_trunc"), "is not a readable safetensors"),
    ("train-hf-bad-json", "train", _hf_load("{d}/hf_badjson"), "is not valid JSON"),
    ("train-hf-no-config", "train", _hf_load("{d}/hf_noconfig"), "config.json does not exist"),
    ("train-hf-other-family", "train", _hf_load("{d}/hf_qwen"),
     "describes a qwen3 model, the run trains llama3"),
    ("train-hf-other-width", "train", _hf_load("{d}/hf_wide"),
     "config.json has hidden_size = 512, the run's model (llama3 debugmodel) has 256"),
    ("train-hf-other-weights", "train", _hf_load("{d}/hf_mixed"),
     "weights of another model family"),
    ("train-hf-unknown-arch", "train", _hf_load("{d}/hf_gpt2"), "which no family here trains"),
    ("train-dcp-root", "train", ["--checkpoint.initial_load_path", "{d}/ck"],
     "is a checkpoint root"),
    ("train-dcp-hf", "train", ["--checkpoint.initial_load_path", "{d}/hf"],
     "add --checkpoint.initial_load_in_hf"),
    ("train-dcp-other-family", "train", ["--checkpoint.initial_load_path", "{d}/qwen_ck/step-1"],
     "is not a llama3 debugmodel checkpoint"),
    ("train-dcp-vocab", "train", ["--checkpoint.initial_load_path", "{d}/ck/step-1",
     "--model.tokenizer_path", "tests/assets/hf_tokenizer"],
     "its embedding has 2048 rows, the run's tokenizer 1024 tokens"),
    ("train-hf-vocab", "train", [*_hf_load("{d}/hf"), "--model.tokenizer_path",
     "tests/assets/hf_tokenizer"], "config.json has vocab_size = 2048, the run's model"),
    ("train-dcp-damaged", "train", ["--checkpoint.initial_load_path", "{d}/ck_damaged/step-1"],
     "is damaged"),
    ("peft-bad-json", "train", [*LORA, "{d}/peft_badjson"], "is not valid JSON"),
    ("peft-no-weights", "train", [*LORA, "{d}/peft_noweights"],
     "adapter_model.safetensors does not exist"),
    ("peft-damaged", "train", [*LORA, "{d}/peft_damaged"], "is not a readable safetensors"),
    ("peft-rank", "train", [*LORA, "{d}/peft_rank4"],
     "r=4, lora_alpha=16, use_rslora=False, but [lora] has rank=8"),
    ("peft-weights-rank", "train", [*LORA, "{d}/peft_weights_rank"], "not rank 8 (its r)"),
    ("peft-not-lora", "train", [*LORA, "{d}/peft_ia3"], "has peft_type 'IA3', not LORA"),
    ("peft-r-text", "train", [*LORA, "{d}/peft_r_text"], "has r = 'eight', not a int > 0"),
]  # fmt: skip


def argv_of(args: list[str], d: Path) -> list[str]:
    return [a.replace("{d}", str(d)) for a in args]


def _write_dcp(root: Path, sd: dict[str, torch.Tensor]) -> Path:
    from torchtitan.checkpoint.storage import write_model_weights

    return write_model_weights(root, 1, sd)


def _weights(family: str, seed: int = 0) -> tuple[object, dict[str, torch.Tensor]]:
    from torchtitan.models import MODELS

    spec = MODELS[family]
    args = spec.flavors["debugmodel"]
    model = spec.build(args)
    model.init_weights(seed=seed)  # type: ignore[operator]
    return args, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _peft(folder: Path, config: dict | None, weights: bytes | None) -> None:
    folder.mkdir()
    if config is not None:
        (folder / "adapter_config.json").write_text(json.dumps(config))
    if weights is not None:
        (folder / "adapter_model.safetensors").write_bytes(weights)


def _peft_weights(rank: int) -> bytes:
    from safetensors.torch import save

    name = "base_model.model.model.layers.0.self_attn.q_proj"
    return save(
        {
            f"{name}.lora_A.weight": torch.zeros(rank, 256),
            f"{name}.lora_B.weight": torch.zeros(256, rank),
        }
    )


def make_weight_folders(d: Path) -> None:
    """Every folder the cases name, under ``d`` (a few seconds: debug-sized models)."""
    from torchtitan import convert

    args, sd = _weights("llama3")
    step = _write_dcp(d / "ck", sd)
    convert.to_hf(step, d / "hf", "llama3", args, None)
    shutil.copytree(d / "ck", d / "ck_damaged")
    data = next((d / "ck_damaged" / "step-1").glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(bytes(raw))
    shutil.copytree(d / "ck", d / "ck_manifest")
    manifest = d / "ck_manifest" / "step-1" / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"sha256"', '"rha256"', 1))
    qargs, qsd = _weights("qwen3")
    convert.to_hf(_write_dcp(d / "qwen_ck", qsd), d / "hf_qwen", "qwen3", qargs, None)
    lora = {"layers.0.attention.wq.lora_A": torch.zeros(8, 256)}
    lora["layers.0.attention.wq.lora_B"] = torch.zeros(256, 8)
    _write_dcp(d / "lora_ck", lora)
    (d / "empty").mkdir()
    (d / "a_file").write_text("a file\n")
    config = json.loads((d / "hf" / "config.json").read_text())
    wide = {**config, "head_dim": 2 * config["head_dim"]} if "head_dim" in config else config
    shard = next((d / "hf").glob("*.safetensors"))
    for name, cfg_text, weights in (
        ("hf_trunc", None, shard.read_bytes()[: shard.stat().st_size // 2]),
        ("hf_garbage", None, b"\x07" * 64),
        ("hf_noconfig", "", None),
        ("hf_badjson", "{not json", None),
        ("hf_nokey", json.dumps({k: v for k, v in config.items() if k != "hidden_size"}), None),
        ("hf_badvalue", json.dumps({**config, "hidden_size": "wide"}), None),
        ("hf_nolayers", json.dumps({**config, "num_hidden_layers": -2}), None),
        ("hf_vocab", json.dumps({**config, "vocab_size": 4096}), None),
        ("hf_wide", json.dumps({**wide, "hidden_size": 512, "intermediate_size": 1536}), None),
    ):
        shutil.copytree(d / "hf", d / name)
        if weights is not None:
            (d / name / shard.name).write_bytes(weights)
        if cfg_text == "":
            (d / name / "config.json").unlink()
        elif cfg_text is not None:
            (d / name / "config.json").write_text(cfg_text)
    _gpt2(d / "hf_gpt2")
    (d / "hf_mixed").mkdir()
    for f in (d / "hf_gpt2").glob("*.safetensors"):
        shutil.copy(f, d / "hf_mixed" / f.name)
    (d / "hf_mixed" / "config.json").write_text(json.dumps(config))
    good = {"peft_type": "LORA", "r": 8, "lora_alpha": 16.0, "target_modules": ["q_proj"]}
    _peft(d / "peft_badjson", None, _peft_weights(8))
    (d / "peft_badjson" / "adapter_config.json").write_text('{"r": 8,')
    _peft(d / "peft_noweights", good, None)
    _peft(d / "peft_damaged", good, _peft_weights(8)[:100])
    _peft(d / "peft_rank4", {**good, "r": 4}, _peft_weights(4))
    _peft(d / "peft_weights_rank", good, _peft_weights(4))
    _peft(d / "peft_ia3", {**good, "peft_type": "IA3"}, _peft_weights(8))
    _peft(d / "peft_r_text", {**good, "r": "eight"}, _peft_weights(8))


def _gpt2(folder: Path) -> None:
    """A tiny GPT-2 (an architecture no family here trains), random weights."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=32)
    cfg.bos_token_id = cfg.eos_token_id = 0
    GPT2LMHeadModel(cfg).save_pretrained(str(folder))


if __name__ == "__main__":
    for _id, entry, args, words in CASES:
        shown = " ".join(args).replace("{d}", "<dir>")
        print(f"| `{entry}` | `{shown}` | {words.replace('{d}', '<dir>')} |")
