"""The ``hf`` family (docs/hf_models.md): any transformers causal LM from a local folder.

One process, no process group: our build of eight architectures we do not implement natively
gives transformers' logits on the same weights, both ways (a transformers folder streamed in
through the family's adapter; our weights streamed out to a folder transformers loads);
the plan is found on the model; bad folders and layouts are one-line ConfigErrors.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.hf_models import ARCHS, TP_PLANS, save_config, save_model
from torchtitan.checkpoint import hf_io
from torchtitan.config.errors import ConfigError
from torchtitan.models import MODELS, runtime_args
from torchtitan.preflight.validate import load_config

SPEC = MODELS["hf"]
VOCAB = 2048  # tests/assets/tokenizer's, what the trainer builds with
FAST = ("mistral", "gemma3")


def _ours(folder: Path, seed: int = 0) -> torch.nn.Module:
    args = runtime_args(SPEC, str(folder), VOCAB, 64)
    with torch.device("meta"):
        model = SPEC.build(args)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    return model.eval()


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))


def _archs() -> list:
    return [a if a in FAST else pytest.param(a, marks=pytest.mark.slow) for a in ARCHS]


@pytest.mark.parametrize("arch", _archs())
def test_import_and_export_give_transformers_logits(arch: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    src = tmp_path / "src"
    theirs = save_model(arch, src).eval()
    ours = _ours(src, seed=7)  # other weights until the import
    adapter = SPEC.state_dict_adapter(runtime_args(SPEC, str(src), VOCAB, 64))
    hf_io.load_hf_streaming([ours], adapter, src)
    tokens = _tokens()
    with torch.no_grad():
        want = theirs(input_ids=tokens).logits
        got = ours(tokens)
    assert (got - want).abs().max().item() == 0.0, f"{arch}: import differs"

    fresh = _ours(src, seed=3)
    out = tmp_path / "out"
    hf_io.save_hf_streaming(dict(fresh.state_dict()), adapter, out)
    back = AutoModelForCausalLM.from_pretrained(out, attn_implementation="sdpa").eval()
    with torch.no_grad():
        diff = (back(input_ids=tokens).logits - fresh(tokens)).abs().max().item()
    assert diff == 0.0, f"{arch}: transformers reads our export {diff} apart"
    assert json.loads((out / "config.json").read_text())["model_type"] == theirs.config.model_type


def test_init_is_seeded_by_name_and_counts_match(tmp_path: Path) -> None:
    folder = save_config("gemma3", tmp_path / "g")
    a, b, c = _ours(folder, 0), _ours(folder, 0), _ours(folder, 1)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if pa.dim() >= 2:
            assert not torch.equal(pa, pc), name
    # Gemma's norms scale by (1 + w): transformers initialises them to zero, and so do we
    assert a.get_submodule("model.norm").weight.abs().max().item() == 0.0
    args = runtime_args(SPEC, str(folder), VOCAB, 64)
    assert SPEC.num_params(args) == sum(p.numel() for p in a.parameters())
    plan = SPEC.parallel_plan(args)
    assert plan.blocks == "model.layers" and len(plan.blocks_of(a)) == 2
    assert "self_attn.q_proj" in plan.tensor_parallel.block


def _argv(folder: Path, *extra: str) -> list[str]:
    return ["--model.name", "hf", "--model.flavor", str(folder), *extra]


def _refused(argv: list[str], world: int = 1) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(argv, world_size=world)
    message = str(e.value)
    assert "\n" not in message
    return message


def test_bad_folders_are_one_line_errors(tmp_path: Path) -> None:
    assert "no config.json" not in _refused(_argv(tmp_path / "none"))
    assert "config.json" in _refused(_argv(tmp_path / "none"))
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"model_type": "llama9000"}))
    assert "does not know" in _refused(_argv(unknown))
    remote = save_config("mistral", tmp_path / "remote")
    config = json.loads((remote / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    (remote / "config.json").write_text(json.dumps(config))
    assert "trust_remote_code" in _refused(_argv(remote))


def test_layouts_the_model_cannot_take_are_refused(tmp_path: Path) -> None:
    mistral = save_config("mistral", tmp_path / "m")
    tp3 = _refused(_argv(mistral, "--parallelism.tensor_parallel_degree", "3"), world=3)
    assert "n_heads=4" in tp3 and "tensor_parallel_degree" in tp3
    pp = _argv(mistral, "--parallelism.pipeline_parallel_degree", "2")
    assert "cannot be cut into stages" in _refused(pp, world=2)
    cp = _argv(mistral, "--parallelism.context_parallel_degree", "2")
    assert "attention core" in _refused(cp, world=2)
    olmoe = save_config("olmoe", tmp_path / "o")
    assert "olmoe" not in TP_PLANS
    moe_tp = _refused(_argv(olmoe, "--parallelism.tensor_parallel_degree", "2"), world=2)
    assert "packed_colwise" in moe_tp or "moe_tp_experts" in moe_tp
    stablelm = tmp_path / "s"
    import transformers

    transformers.StableLmConfig(**{"hidden_size": 64, "num_hidden_layers": 1}).save_pretrained(
        stablelm
    )
    no_plan = _refused(_argv(stablelm, "--parallelism.tensor_parallel_degree", "2"), world=2)
    assert "no base_model_tp_plan" in no_plan


def test_lora_adapters_export_to_peft(tmp_path: Path) -> None:
    """Default LoRA targets on an hf Mistral; its PEFT export on transformers' model of the same
    base gives our logits (fp32, 1e-5)."""
    import peft
    from transformers import AutoModelForCausalLM

    from torchtitan.config.job_config import Lora
    from torchtitan.lora.apply import apply_lora, init_adapters, with_targets
    from torchtitan.lora.layers import is_adapter_name
    from torchtitan.lora.peft_io import save_peft_adapters

    folder = save_config("mistral", tmp_path / "m")
    model = _ours(folder, seed=1)
    args = runtime_args(SPEC, str(folder), VOCAB, 64)
    cfg = with_targets(Lora(enable=True, rank=4, alpha=8.0), SPEC, args)
    apply_lora(model, cfg)
    init_adapters(model, seed=2)
    with torch.no_grad():  # B starts at zero: give it values so the update shows
        gen = torch.Generator().manual_seed(5)
        for name, p in model.named_parameters():
            if is_adapter_name(name) and "lora_B" in name:
                p.normal_(0.0, 0.2, generator=gen)
    adapter = SPEC.state_dict_adapter(runtime_args(SPEC, str(folder), VOCAB, 64))
    base = {k: v for k, v in model.state_dict().items() if not is_adapter_name(k)}
    hf_io.save_hf_streaming(base, adapter, tmp_path / "base")
    written = save_peft_adapters(tmp_path / "peft", dict(model.state_dict()), adapter, cfg)
    assert len(written) == 2 * 4 * 2  # A and B, four projections, two layers
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "base", attn_implementation="sdpa")
    theirs = peft.PeftModel.from_pretrained(hf, tmp_path / "peft").eval()
    tokens = _tokens()
    with torch.no_grad():
        diff = (theirs(input_ids=tokens).logits - model.eval()(tokens)).abs().max().item()
    assert diff <= 1e-5, diff


def test_estimate_is_generic_and_equals_native_at_the_same_shape() -> None:
    """train_configs/hf/llama3_debugmodel is Llama 3 debugmodel's shape as a transformers
    folder: the estimator, reading the hf family's shape generically, gives the native total
    and says the estimate is generic."""
    from torchtitan.planner.estimator import estimate_memory

    ROOT = Path(__file__).resolve().parents[2]
    folder = str(ROOT / "train_configs" / "hf" / "llama3_debugmodel")
    base = ["--job.config_file", str(ROOT / "train_configs" / "debug_model.toml")]
    native = estimate_memory(load_config(base, world_size=2), 2, device_type="cpu")
    ours = estimate_memory(load_config([*base, *_argv(Path(folder))], world_size=2), 2)
    ours_cpu = estimate_memory(
        load_config([*base, *_argv(Path(folder))], world_size=2), 2, device_type="cpu"
    )
    assert ours_cpu.total == native.total and ours.total > 0
    assert any("generic estimate" in n for n in ours_cpu.notes)
    assert not any("generic estimate" in n for n in native.notes)
    args = runtime_args(SPEC, folder, VOCAB, 512)
    llama = runtime_args(MODELS["llama3"], "debugmodel", VOCAB, 512)
    assert SPEC.num_params(args) == MODELS["llama3"].num_params(llama)


def test_eval_loading_and_generation_match_transformers(tmp_path: Path) -> None:
    """lm-eval's and scripts/generate.py's loader reads an hf folder with ``--model hf``; greedy
    generation with our KV cache, without it, and transformers' own give the same tokens."""
    from tests.script_loader import load
    from torchtitan.eval.loading import load_weights, materialize

    src = tmp_path / "src"
    theirs = save_model("granite", src).eval()
    family, args, sd = load_weights(src, True, "hf", str(src))
    assert family == "hf"
    with torch.device("meta"):
        model = SPEC.build(args)
    model = materialize(model, sd, torch.device("cpu"), torch.float32, sharded=False)
    tokens = _tokens()
    with torch.no_grad():
        assert torch.equal(model(tokens), theirs(input_ids=tokens).logits)
    generate = load("scripts/generate.py").generate
    prompt = tokens[:, :8]
    cached = generate(model, prompt, 6, use_cache=True)
    plain = generate(model, prompt, 6, use_cache=False)
    with torch.no_grad():
        want = theirs.generate(prompt, max_new_tokens=6, do_sample=False, min_new_tokens=6)
    assert torch.equal(cached, plain) and torch.equal(plain, want), (cached, plain, want)


def test_train_entry_point_exits_2_on_a_bad_folder(tmp_path: Path, capsys) -> None:
    from torchtitan.train import main

    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"model_type": "llama9000"}))
    assert main(_argv(unknown)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert any("llama9000" in line and "model.flavor" in line for line in err), err
