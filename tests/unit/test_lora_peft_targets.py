"""A PEFT folder saved by ``peft`` itself against the ``[lora]`` settings (docs/lora.md,
"Interop"): adapters the folder has and the config leaves out (or the reverse), or another
rank/alpha, are refused in one line naming them and the fix, before launch;
``lora.adapter_targets = "from_adapter"`` adapts every module the folder has, and then our
logits equal ``peft.PeftModel``'s on transformers (fp32, 1e-5 relative)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import hf_parity
from tests.tiny_args import tiny_llama3
from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import Lora
from torchtitan.config.manager import parse_args
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.lora.apply import apply_lora, with_targets
from torchtitan.lora.peft_io import AdapterMismatch, check_adapters, load_into
from torchtitan.models import MODELS
from torchtitan.preflight.validate_lora import validate_lora

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EVERY = [*ATTENTION, "gate_proj", "up_proj", "down_proj"]
ARGS = tiny_llama3(dim=64, heads=(4, 2), vocab=256)


def _peft_folder(args: Any, folder: Path, targets: list[str], r: int = 4) -> Any:
    """A transformers Llama of ``args``' shape (random) saved to ``folder/base`` and a PEFT
    LoRA on ``targets`` (random A and B) saved to ``folder/peft``; returns the PeftModel."""
    adapter = MODELS["llama3"].state_dict_adapter(args)
    config = transformers.LlamaConfig(**adapter.hf_config())
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config)
    hf.save_pretrained(folder / "base")
    lora = peft.LoraConfig(r=r, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    model = peft.get_peft_model(hf, lora)
    model.save_pretrained(folder / "peft")
    return model


def _ours(folder: Path, cfg: Lora) -> tuple[Any, Any, Any]:
    """Our model of the saved base with ``cfg``'s adapters (targets resolved)."""
    args, ours, _ = hf_parity.import_hf(
        transformers.LlamaForCausalLM.from_pretrained(folder / "base"), folder / "base"
    )
    spec = MODELS["llama3"]
    apply_lora(ours, with_targets(cfg, spec, args))
    return args, ours, spec.state_dict_adapter(args)


def _cfg(**kw: Any) -> Lora:
    base = {"enable": True, "rank": 4, "alpha": 8.0, "adapter_path": ""}
    return Lora(**{**base, **kw})


def test_extra_adapters_are_refused_and_from_adapter_loads_them(tmp_path: Path) -> None:
    """The reported case: a folder with attention and MLP adapters, a config adapting attention
    only, used to load the attention ones and drop the rest without a word."""
    theirs = _peft_folder(ARGS, tmp_path, EVERY)
    path = str(tmp_path / "peft")
    _, ours, adapter = _ours(tmp_path, _cfg(adapter_path=path, target_modules=["attention.w*"]))
    with pytest.raises(AdapterMismatch) as e:
        load_into(ours, tmp_path / "peft", adapter, _cfg(adapter_path=path))
    msg = str(e.value)
    assert "has adapters for 6 modules lora.target_modules leaves out" in msg, msg
    assert "model.layers.0.mlp.down_proj" in msg and "\n" not in msg
    assert "feed_forward.w1,feed_forward.w2,feed_forward.w3" in msg
    assert "--lora.adapter_targets from_adapter" in msg

    cfg = _cfg(adapter_path=path, adapter_targets="from_adapter")
    args, ours, adapter = _ours(tmp_path, cfg)
    n = load_into(ours, tmp_path / "peft", adapter, cfg)
    assert n == 2 * 7 * ARGS.n_layers
    tokens = hf_parity.tokens()
    with torch.no_grad():
        got, want = ours.eval()(tokens), theirs.eval()(input_ids=tokens).logits
    rel = ((got - want).abs().max() / want.abs().max()).item()
    print(f"from_adapter: {n} tensors, logits max relative diff vs PeftModel {rel:.1e}")
    assert rel <= 1e-5, rel


def test_missing_adapters_and_other_rank_are_refused(tmp_path: Path) -> None:
    _peft_folder(ARGS, tmp_path, ATTENTION)
    path = str(tmp_path / "peft")
    cfg = _cfg(adapter_path=path, target_modules=["attention.w*", "feed_forward.w1"])
    _, ours, adapter = _ours(tmp_path, cfg)
    with pytest.raises(AdapterMismatch, match=r"has no adapters for 2 modules .*gate_proj"):
        check_adapters(tmp_path / "peft", adapter, ours, cfg)
    cfg = _cfg(adapter_path=path, rank=8)
    _, ours, adapter = _ours(tmp_path, cfg)
    with pytest.raises(AdapterMismatch, match=r"r=4, lora_alpha=8.*--lora.rank 4 --lora.alpha 8"):
        check_adapters(tmp_path / "peft", adapter, ours, cfg)
    # The folder's own modules, exactly: loads.
    cfg = _cfg(adapter_path=path, target_modules=["attention.w*"])
    _, ours, adapter = _ours(tmp_path, cfg)
    assert load_into(ours, tmp_path / "peft", adapter, cfg) == 2 * 4 * ARGS.n_layers


def test_preflight_refuses_a_mismatched_folder(tmp_path: Path) -> None:
    """The same check before launch (``validate_lora``): one ConfigError on lora.adapter_path;
    ``from_adapter`` with target_modules set is refused, without them accepted."""
    args = MODELS["llama3"].flavors["debugmodel"]
    _peft_folder(args, tmp_path, EVERY)
    path = str(tmp_path / "peft")
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, world_size=1)
    argv = ["--model.name", "llama3", "--model.flavor", "debugmodel", "--lora.enable"]
    argv += ["--lora.rank", "4", "--lora.alpha", "8"]
    cfg = parse_args([*argv, "--lora.adapter_path", path])
    with pytest.raises(ConfigError, match=r"^lora.adapter_path = .*leaves out.*Fix: add") as e:
        validate_lora(cfg, dims)
    assert "\n" not in str(e.value)
    cfg.lora = dataclasses.replace(cfg.lora, adapter_targets="from_adapter")
    validate_lora(cfg, dims)
    cfg.lora = dataclasses.replace(cfg.lora, target_modules=["attention.wq"])
    with pytest.raises(ConfigError, match=r"^lora.adapter_targets = 'from_adapter'"):
        validate_lora(cfg, dims)
