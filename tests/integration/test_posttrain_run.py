"""The post-training modes end to end through ``python -m torchtitan.train`` with
train_configs/debug_dpo.toml and debug_grpo.toml (docs/posttrain.md, "Running"): a run of 4
steps (checkpoints at 2 and 4) and a run resumed from the step-2 checkpoint end bitwise equal:
weights, optimizer state, the reference's frozen shards, the sampling generator (GRPO) and the
logged losses and mode metrics of steps 3-4. The DPO checkpoint converts to Hugging Face."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.launcher import run_train_env

ROOT = Path(__file__).resolve().parents[2]
FSDP2 = "fsdp2"  # marker: launch on 2 ranks (run_train.sh, data_parallel_shard_degree -1 = 2)
FAST = ["--training.mixed_precision_param", "float32", "--checkpoint.interval", "2"]
FAST += ["--training.steps", "4", "--lr_scheduler.warmup_steps", "1"]
GRPO_FAST = ["--grpo.k", "2", "--grpo.prompts_per_step", "2", "--grpo.max_new_tokens", "3"]
GRPO_FAST += ["--training.seq_len", "32", "--optimizer.lr", "1e-3"]
# exact_match, plus a user callable by import path whose value varies for an untrained model
GRPO_FAST += ["--grpo.rewards", "exact_match,tests.posttrain_helpers:text_length"]


def _train(config: str, dump: Path, *args: str) -> subprocess.CompletedProcess:
    """``python -m torchtitan.train`` (one process), or ``run_train.sh`` on 2 CPU ranks (FSDP 2)
    when ``args`` holds ``FSDP2``."""
    if FSDP2 in args:
        cmd, env = [str(ROOT / "run_train.sh")], dict(run_train_env(), CONFIG_FILE=config)
        args = tuple(a for a in args if a != FSDP2)
    else:
        cmd, env = [sys.executable, "-m", "torchtitan.train", "--job.config_file", config], None
    cmd += ["--job.dump_folder", str(dump), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def _ok(proc: subprocess.CompletedProcess) -> str:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out


def _records(dump: Path) -> dict[int, dict]:
    lines = (dump / "metrics" / "rank_0.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


def _state(step_dir: Path, tmp: Path) -> dict:
    out = tmp / f"{step_dir.parent.parent.name}.pt"
    dcp_to_torch_save(step_dir, out)
    return torch.load(out, weights_only=False)


def _flat(tree: object, prefix: str = "") -> dict[str, object]:
    if isinstance(tree, dict):
        out: dict[str, object] = {}
        for k, v in tree.items():
            out |= _flat(v, f"{prefix}{k}.")
        return out
    return {prefix[:-1]: tree}


def _resume_matches(config: str, mode: str, tmp: Path, *args: str) -> dict[int, dict]:
    straight, resumed = tmp / "straight", tmp / "resumed"
    _ok(_train(config, straight, *FAST, *args))
    (resumed / "checkpoint").mkdir(parents=True)
    shutil.copytree(straight / "checkpoint" / "step-2", resumed / "checkpoint" / "step-2")
    out = _ok(_train(config, resumed, *FAST, *args))
    assert "resuming after step 2" in out, out[-3000:]
    a = _flat(_state(straight / "checkpoint" / "step-4", tmp))
    b = _flat(_state(resumed / "checkpoint" / "step-4", tmp))
    assert a.keys() == b.keys()
    assert any(k.startswith("posttrain.") for k in a), sorted(a)
    tensors = [k for k in a if isinstance(a[k], torch.Tensor) and not k.startswith("train_state")]
    for k in tensors:
        assert torch.equal(a[k], b[k]), k  # type: ignore[arg-type]
    first, second = _records(straight), _records(resumed)
    assert sorted(second) == [3, 4]
    for step in (3, 4):
        for key in ["loss", *(k for k in first[step] if k.startswith(f"{mode}/"))]:
            assert first[step][key] == second[step][key], (step, key)
    return first


def test_dpo_run_resumes_bitwise_and_exports(tmp_path: Path) -> None:
    config = str(ROOT / "train_configs" / "debug_dpo.toml")
    records = _resume_matches(config, "dpo", tmp_path, "--optimizer.lr", "1e-3")
    assert records[1]["loss"] == pytest.approx(0.6931472, abs=1e-6)  # policy = reference: log 2
    assert records[4]["dpo/rewards/margins"] != 0.0
    assert {"dpo/rewards/chosen", "dpo/rewards/rejected", "dpo/rewards/accuracy"} <= set(records[4])
    # The DPO checkpoint is an ordinary model checkpoint: it converts to Hugging Face.
    hf = tmp_path / "hf"
    step4 = tmp_path / "straight" / "checkpoint" / "step-4"
    cmd = [sys.executable, "scripts/convert_to_hf.py", str(step4), str(hf)]  # llama3 debugmodel
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert (hf / "config.json").is_file() and list(hf.glob("*.safetensors"))


def test_grpo_run_resumes_bitwise(tmp_path: Path) -> None:
    config = str(ROOT / "train_configs" / "debug_grpo.toml")
    records = _resume_matches(config, "grpo", tmp_path, *GRPO_FAST)
    assert records[1]["grpo/kl"] == 0.0 and records[4]["grpo/kl"] > 0.0  # the policy moved
    assert records[4]["grpo/reward_std"] > 0.0
    assert records[4]["grpo/completion_length"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["dpo", "grpo"])
def test_fsdp2_run_resumes_bitwise(tmp_path: Path, mode: str) -> None:
    """The same on 2 ranks (FSDP 2): the reference's shards are DTensors in the checkpoint,
    each rank's generator its own entry."""
    config = str(ROOT / "train_configs" / f"debug_{mode}.toml")
    args = ["--training.seq_len", "32"] if mode == "dpo" else GRPO_FAST
    _resume_matches(config, mode, tmp_path, FSDP2, *args)


def test_lora_dpo_run_exports_peft_adapters(tmp_path: Path) -> None:
    """DPO with ``lora.enable`` from a Hugging Face base (the reference is the base, adapters
    off): ``scripts/export_lora.py`` writes PEFT adapters that ``peft`` loads onto the base and
    that give our trained model's logits."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import save_file

    from tests.script_loader import load
    from torchtitan.checkpoint.storage import read_model_weights
    from torchtitan.config.manager import parse_args
    from torchtitan.data.tokenizer import build_tokenizer
    from torchtitan.lora.apply import apply_lora
    from torchtitan.models import MODELS
    from torchtitan.models.spec import runtime_args

    toml = ["--job.config_file", str(ROOT / "train_configs" / "debug_dpo.toml"), "--lora.enable"]
    toml += ["--lora.target_modules", "attention.wq,attention.wv,feed_forward.w2"]
    cfg, spec, base = parse_args(toml), MODELS["llama3"], tmp_path / "base"
    vocab = build_tokenizer(str(ROOT / cfg.model.tokenizer_path)).vocab_size
    args = runtime_args(spec, cfg.model.flavor, vocab, 64)
    model = spec.build(args)
    model.init_weights(seed=5)
    adapter = spec.state_dict_adapter(args)
    base.mkdir()
    save_file(adapter.to_hf(dict(model.state_dict())), str(base / "model.safetensors"))
    (base / "config.json").write_text(json.dumps(adapter.hf_config()))

    dump = tmp_path / "run"
    run = [*FAST[:2], "--training.steps", "2", "--checkpoint.interval", "2", *toml[2:]]
    run += ["--checkpoint.initial_load_path", str(base), "--checkpoint.initial_load_in_hf"]
    run += [
        "--optimizer.lr",
        "1e-2",
        "--lr_scheduler.warmup_steps",
        "1",
        "--training.seq_len",
        "32",
    ]
    _ok(_train(toml[1], dump, *run))
    ckpt = dump / "checkpoint" / "step-2"
    adapters = read_model_weights(ckpt)
    load("scripts/export_lora.py").export(ckpt, base, tmp_path / "peft", toml, merged=False)

    ours = spec.build(args)
    apply_lora(ours, cfg.lora)
    ours.load_state_dict({**dict(model.state_dict()), **adapters})
    ours.init_buffers()
    ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    hf = transformers.LlamaForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        plain = hf(input_ids=ids).logits
        theirs = peft.PeftModel.from_pretrained(hf, tmp_path / "peft").eval()(input_ids=ids).logits
        mine = ours.eval()(ids)
    assert (theirs - plain).abs().max() > 1e-4  # DPO moved the adapters
    torch.testing.assert_close(theirs, mine, atol=1e-4, rtol=1e-4)
