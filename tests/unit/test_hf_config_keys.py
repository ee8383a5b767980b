"""Every Hugging Face ``config.json`` key is honoured or refused (docs/hf_io.md, "Config keys").

A grid of tiny random transformers models per family over RoPE scaling, sliding windows and tied
embeddings: each is saved with ``save_pretrained``, imported through our path (the family from
``config.json``) and must give transformers' logits and gradients (fp32, relative 1e-5); our
export must load back in transformers with equal logits. Values we cannot compute are refused
with one line naming the key; unknown keys are warned about; the generated doc is current.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from tests import hf_parity
from tests.tiny_args import tiny_hf_cases
from torchtitan.models import MODELS, check_hf_config, family_for_hf_config
from torchtitan.models.common.hf.keys import HFConfigError

_ROPE: dict[str, dict[str, Any] | None] = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "yarn-mscale": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
        "beta_fast": 16.0,
        "truncate": False,
    },
}
_SHAPE: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    initializer_range=0.2,  # attention far from uniform: RoPE and windows show in the logits
    rope_theta=10000.0,
)


def _llama(rope: str, tie: bool) -> Any:
    return transformers.LlamaConfig(
        **_SHAPE, intermediate_size=192, num_hidden_layers=2, tie_word_embeddings=tie
    ), rope


def _qwen3(window: str) -> Callable[[str, bool], Any]:
    def make(rope: str, tie: bool) -> Any:
        win: dict[str, Any] = {}
        if window == "max_window_layers":
            win = dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)
        elif window == "layer_types":
            types = ["sliding_attention", "full_attention", "sliding_attention"]
            win = dict(use_sliding_window=True, sliding_window=6, layer_types=types)
        config = transformers.Qwen3Config(
            **_SHAPE,
            intermediate_size=96,
            num_hidden_layers=3,
            head_dim=16,
            tie_word_embeddings=tie,
            **win,
        )
        return config, rope

    return make


def _qwen3_moe(window: bool) -> Callable[[str, bool], Any]:
    def make(rope: str, tie: bool) -> Any:
        config = transformers.Qwen3MoeConfig(
            **_SHAPE,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_hidden_layers=2,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            use_sliding_window=window,
            sliding_window=8,
            tie_word_embeddings=tie,
        )
        return config, rope

    return make


def _gpt_oss(rope: str, tie: bool) -> Any:
    shape = {**_SHAPE, "num_key_value_heads": 2}
    config = transformers.GptOssConfig(
        **shape,
        intermediate_size=32,
        num_hidden_layers=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        tie_word_embeddings=tie,
    )
    return config, rope


def _deepseek_v3(rope: str, tie: bool) -> Any:
    shape = {**_SHAPE, "num_key_value_heads": 4}
    config = transformers.DeepseekV3Config(
        **shape,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        num_nextn_predict_layers=0,  # transformers builds no MTP layers (hf.py converts them)
        tie_word_embeddings=tie,
    )
    return config, rope


def _case(family: str, make: Callable[[str, bool], Any], ropes: tuple[str, ...]) -> list[Any]:
    return [
        pytest.param(make, rope, tie, id=f"{family}-{rope}-{'tied' if tie else 'untied'}")
        for rope in ropes
        for tie in (False, True)
    ]


GRID = [
    *_case("llama3", _llama, ("default", "linear", "llama3", "yarn", "yarn-mscale")),
    *_case("qwen3", _qwen3("none"), ("default", "yarn")),
    *_case("qwen3-window-max_window_layers", _qwen3("max_window_layers"), ("linear", "yarn")),
    *_case("qwen3-window-layer_types", _qwen3("layer_types"), ("llama3",)),
    *_case("qwen3_moe", _qwen3_moe(False), ("yarn",)),
    *_case("qwen3_moe-window", _qwen3_moe(True), ("default", "yarn")),
    *_case("gpt_oss", _gpt_oss, ("default", "yarn-mscale")),
    *_case("deepseek_v3", _deepseek_v3, ("default", "yarn-mscale")),
]


def _hf_model(make: Callable[[str, bool], Any], rope: str, tie: bool) -> Any:
    config, rope = make(rope, tie)
    params = _ROPE[rope]
    config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0, **(params or {})}
    config.standardize_rope_params()
    torch.manual_seed(0)
    arch = {"llama": "Llama", "qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe", "gpt_oss": "GptOss"}
    arch["deepseek_v3"] = "DeepseekV3"
    cls = getattr(transformers, f"{arch[config.model_type]}ForCausalLM")
    config._attn_implementation = "eager"
    return cls(config).float().eval()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _backward(model: Any, logits: torch.Tensor) -> None:
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1))
    (logits * weights).sum().backward()


@pytest.mark.parametrize("make,rope,tie", GRID)
def test_import_and_export_match_transformers(
    make: Callable[[str, bool], Any], rope: str, tie: bool, tmp_path: Path
) -> None:
    hf = _hf_model(make, rope, tie)
    args, ours, _ = hf_parity.import_hf(hf, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    family, _ = family_for_hf_config(config)
    assert check_hf_config(family, config) == [], "transformers' own keys must all be known"

    tokens = hf_parity.tokens()
    theirs, mine = hf(tokens).logits, ours(tokens)
    logit_rel = _rel(mine, theirs)
    _backward(hf, theirs)
    _backward(ours, mine)
    adapter = MODELS[family].state_dict_adapter(args)
    hf_grads = {n: p.grad for n, p in hf.named_parameters() if p.grad is not None}
    want = adapter.from_hf(hf_grads)
    got = {n: p.grad for n, p in ours.named_parameters() if p.grad is not None}
    assert set(got) <= set(want), set(got) - set(want)
    grad_rel = {n: _rel(g, want[n]) for n, g in got.items()}
    worst = max(grad_rel, key=grad_rel.__getitem__)

    (tmp_path / "out").mkdir()
    export_diff = hf_parity.export_logit_diff(ours, adapter, type(hf), tmp_path / "out")
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    print(
        f"{family} {rope} tie={tie}: logits {logit_rel:.1e}, worst grad {worst} "
        f"{grad_rel[worst]:.1e}, export {export_diff:.1e}"
    )
    assert logit_rel <= 1e-5, logit_rel
    assert grad_rel[worst] <= 1e-5, (worst, grad_rel[worst])
    assert export_diff <= 1e-5 * theirs.abs().max().item(), export_diff
    assert check_hf_config(family, exported) == [], "our export's keys must all be known"
    assert family_for_hf_config(exported)[1] == args, "export round trip"


def test_the_grid_can_fail_a_dropped_window_or_scaling_is_far_off(tmp_path: Path) -> None:
    """The user's report: Qwen3-MoE with a window and YaRN imported without them is far off
    transformers (both matter by themselves here); the grid would catch either being dropped."""
    hf = _hf_model(_qwen3_moe(True), "yarn", False)
    args, ours, sd = hf_parity.import_hf(hf, tmp_path)
    theirs = hf(hf_parity.tokens()).logits.detach()
    for drop in ({"sliding_window": None}, {"rope_scaling": None}):
        wrong = MODELS["qwen3"].build(dataclasses.replace(args, **drop))
        wrong.load_state_dict(ours.state_dict())
        wrong.init_buffers()  # type: ignore[operator]
        with torch.no_grad():
            rel = _rel(wrong(hf_parity.tokens()), theirs)
        print(f"dropping {drop}: logits {rel:.2f} relative")
        assert rel > 1e-2, (drop, rel)


def test_windowed_yarn_generation_with_cache_equals_transformers(tmp_path: Path) -> None:
    """Greedy decoding past the window (8) and the original context (16): with the KV cache,
    without it, and transformers' ``generate`` give the same tokens."""
    from tests.script_loader import load

    gen = load("scripts/generate.py")
    hf = _hf_model(_qwen3("max_window_layers"), "yarn", True)
    _, ours, _ = hf_parity.import_hf(hf, tmp_path)
    prompt = hf_parity.tokens()[:, :12]
    cached = gen.generate(ours.eval(), prompt, 20)
    assert torch.equal(cached, gen.generate(ours, prompt, 20, use_cache=False))
    theirs = hf.generate(prompt, max_new_tokens=20, min_new_tokens=20, do_sample=False)
    assert torch.equal(theirs, cached), (theirs, cached)


def _tiny_config(case: str) -> tuple[str, dict[str, Any]]:
    family, args = tiny_hf_cases()[case]
    return family, MODELS[family].state_dict_adapter(args).hf_config()  # type: ignore[union-attr]


REFUSED = [
    ("qwen3", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
    ("llama3", {"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "longrope"),
    ("llama3", {"use_sliding_window": True}, "use_sliding_window"),
    ("llama3", {"sliding_window": 4096}, "sliding_window"),
    ("qwen3", {"hidden_act": "gelu"}, "hidden_act"),
    ("qwen3", {"attention_bias": True}, "attention_bias"),
    ("qwen3", {"attention_dropout": 0.1}, "attention_dropout"),
    ("qwen3", {"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
    ("llama3", {"head_dim": 64}, "head_dim"),
    ("llama3", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ("gpt_oss", {"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "linear"),
    ("gpt_oss", {"quantization_config": {"quant_method": "mxfp4"}}, "quantization_config"),
    ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func"),
    ("deepseek_v3", {"rope_interleave": False}, "rope_interleave"),
]


@pytest.mark.parametrize("case,edit,named", REFUSED, ids=[f"{c}-{n}" for c, _, n in REFUSED])
def test_unsupported_values_are_refused_in_one_line(
    case: str, edit: dict[str, Any], named: str
) -> None:
    family, config = _tiny_config(case)
    config.update(edit)
    with pytest.raises(HFConfigError) as e:
        family_for_hf_config(config)
    msg = str(e.value)
    print(msg)
    assert "\n" not in msg and named in msg and "Fix:" in msg, msg
    with pytest.raises(HFConfigError):
        check_hf_config(family, config)


def test_unknown_keys_are_warned_about_by_name() -> None:
    family, config = _tiny_config("qwen3")
    config["brand_new_switch"] = 3
    warnings = check_hf_config(family, config)
    assert len(warnings) == 1 and "'brand_new_switch'" in warnings[0], warnings
    family_for_hf_config(config)  # still imports


@pytest.mark.parametrize("case", sorted(tiny_hf_cases()))
def test_every_exported_key_is_in_the_table(case: str) -> None:
    family, config = _tiny_config(case)
    assert check_hf_config(family, config) == []


def _refused_folder(folder: Path) -> Path:
    """A transformers Qwen3 folder whose ``config.json`` asks for dynamic NTK RoPE."""
    hf = _hf_model(_qwen3("none"), "default", False)
    hf.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("entry", ["convert", "generate"])
def test_entry_points_exit_2_with_one_line(
    entry: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``python -m torchtitan.convert from-hf`` and ``scripts/generate.py --hf`` (evaluation's
    reader) print the refusal as one line and exit 2."""
    from tests.script_loader import load
    from torchtitan import convert

    folder = _refused_folder(tmp_path / "hf")
    capsys.readouterr()  # save_pretrained's progress bar
    if entry == "convert":
        code = convert.main(["from-hf", str(folder), str(tmp_path / "out"), "--model", "qwen3"])
    else:
        code = load("scripts/generate.py").main([str(folder), "--hf"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "rope_parameters" in err[0] and "dynamic" in err[0], err


def test_training_builds_the_folders_window_and_yarn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``checkpoint.initial_load_in_hf`` on a folder whose config.json adds a sliding window and
    YaRN to the flavor's shapes: the run builds that model (``models.run_args``, what the trainer
    and the estimator build) and its logits equal transformers'; the preflight reads the same
    args (a windowed Qwen3 refuses context parallel)."""
    from torchtitan.checkpoint.hf_io import load_hf_streaming
    from torchtitan.config.errors import ConfigError
    from torchtitan.config.manager import parse_args
    from torchtitan.models import run_args
    from torchtitan.preflight.validate_parallel import validate_context_parallel

    family, flavor = tiny_hf_cases()["qwen3"]
    spec = MODELS[family]
    monkeypatch.setitem(spec.flavors, "tiny", flavor)  # type: ignore[index]
    config = spec.state_dict_adapter(flavor).hf_config()  # type: ignore[union-attr]
    config.update(use_sliding_window=True, sliding_window=8, max_window_layers=0)
    del config["layer_types"]  # else transformers (and we) window only the layers it names
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    config["rope_parameters"] = {"rope_theta": flavor.rope_theta, **yarn}
    hf_config = transformers.Qwen3Config(**config)
    hf_config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(hf_config).float().eval()
    hf.save_pretrained(tmp_path)
    argv = ["--model.name", family, "--model.flavor", "tiny", "--training.seq_len", "64"]
    argv += ["--checkpoint.initial_load_path", str(tmp_path), "--checkpoint.initial_load_in_hf"]
    cfg = parse_args(argv)

    args = run_args(cfg, flavor.vocab_size)
    assert args.sliding_window == 8 and flavor.sliding_window is None
    assert args.rope_scaling != flavor.rope_scaling
    with torch.device("meta"):
        ours = spec.build(args)
    ours.to_empty(device="cpu")
    load_hf_streaming([ours], spec.state_dict_adapter(args), tmp_path)
    ours.init_buffers()  # type: ignore[operator]
    with torch.no_grad():
        rel = _rel(ours(hf_parity.tokens()), hf(hf_parity.tokens()).logits)
    print(f"training's args from a windowed YaRN folder: logits {rel:.1e} relative")
    assert rel <= 1e-5, rel

    cfg.parallelism.context_parallel_degree = 2
    with pytest.raises(ConfigError, match="does not support context parallel"):
        validate_context_parallel(cfg, 2, 1)


def test_hf_io_doc_tables_are_current() -> None:
    from torchtitan.models.hf_keys_doc import DOC, render

    page = DOC.read_text()
    assert render(page) == page, "run python -m torchtitan.models.hf_keys_doc"


def test_windowed_qwen3_counts_its_keys_and_offers_no_context_parallel() -> None:
    from tests.tiny_args import tiny_qwen3
    from torchtitan.models.qwen3.parallel_plan import qwen3_parallel_plan

    full = tiny_qwen3(n_layers=3)
    windowed = dataclasses.replace(full, sliding_window=8, window_layers=(1, 2))
    per_key = 12 * full.n_heads * full.head_dim
    assert full.flops_per_token(40) - windowed.flops_per_token(40) == per_key * 2 * (40 - 8)
    assert windowed.flops_per_token(8) == full.flops_per_token(8)
    assert qwen3_parallel_plan(full).context_parallel is not None
    assert qwen3_parallel_plan(windowed).context_parallel is None


_NOT_MODEL_KEYS = ("model_type", "architectures", "torch_dtype", "dtype")


@pytest.mark.parametrize("case", sorted(tiny_hf_cases()))
def test_an_absent_key_means_what_transformers_builds(case: str) -> None:
    """Each key of our export left out of ``config.json`` in turn: where transformers still
    builds a model (the key's class default, or what it derives), ours is the same model (equal
    args to those read with transformers' value written in) or a one-line refusal; never a
    silently different one (``routed_scaling_factor`` read as 1.0 where transformers routes at
    2.5, ``norm_topk_prob`` read as true where Qwen3-MoE's default is false, GPT-OSS's YaRN
    dropped, Qwen3.5's partial-rotary theta replaced)."""
    family, args = tiny_hf_cases()[case]
    full = json.loads(json.dumps(MODELS[family].hf.config.to_hf(args)))  # type: ignore[attr-defined]
    model_type, checked = full["model_type"], 0
    for key in sorted(set(full) - set(_NOT_MODEL_KEYS)):
        rest = {k: v for k, v in full.items() if k != key}
        try:
            theirs = transformers.AutoConfig.for_model(
                model_type, **{k: v for k, v in rest.items() if k != "model_type"}
            ).to_dict()
        except Exception:  # transformers itself needs the key
            continue
        if key not in theirs:
            continue
        try:
            absent = family_for_hf_config(rest)[1]
        except KeyError:  # a shape every file states: "config.json lacks the key" at entry
            continue
        except ValueError:  # ConfigError is a ValueError: a one-line refusal
            continue
        try:
            written = family_for_hf_config({**rest, key: theirs[key]})[1]
        except ValueError:  # transformers' default does not fit this tiny config's shapes
            continue
        assert absent == written, f"{case}: without {key!r} we build another model"
        checked += 1
    assert checked >= 3, checked
