"""``scripts/export_lora.py`` never reads the base folder whole (docs/lora.md, "Export"): the
merged export streams it a tensor at a time and equals folding the adapters into the whole state
dict (bitwise), for plain projections and grouped experts; the PEFT export reads only the
base's ``config.json``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.script_loader import load
from tests.tiny_args import tiny_llama3
from tests.unit.test_lora_peft import ALL, FFN, QWEN_MOE, lora_model
from torchtitan.checkpoint import hf_io
from torchtitan.checkpoint.storage import write_model_weights
from torchtitan.lora.layers import is_adapter_name
from torchtitan.lora.peft_io import merge_adapters

CASES = {
    "llama3": ("llama3", tiny_llama3(dim=64, heads=(4, 2), vocab=256), ALL + FFN),
    "qwen3_moe_experts": ("qwen3", QWEN_MOE, ["attention.wq", "feed_forward.experts"]),
}


def _setup(case: str, tmp_path: Path) -> tuple[Any, list[str], dict, Any]:
    family, args, targets = CASES[case]
    model, cfg, adapter = lora_model(family, args, targets)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    base = {k: v for k, v in sd.items() if not is_adapter_name(k)}
    hf_io.save_hf_streaming(base, adapter, tmp_path / "base")
    adapters = {k: v for k, v in sd.items() if is_adapter_name(k)}
    write_model_weights(tmp_path / "ckpt", 1, adapters)
    argv = ["--model.name", family, "--lora.enable", "--lora.rank", str(cfg.rank)]
    argv += ["--lora.alpha", str(cfg.alpha), "--lora.use_rslora"]
    argv += ["--lora.target_modules", ",".join(targets)]
    return adapter, argv, sd, cfg


@pytest.mark.parametrize("case", list(CASES))
def test_merged_export_streams_and_equals_the_whole_merge(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from safetensors.torch import load_file

    adapter, argv, sd, cfg = _setup(case, tmp_path)
    export = load("scripts/export_lora.py")
    reads: list[int] = []
    real_release = hf_io.SafetensorsFolder.release

    def release(self: hf_io.SafetensorsFolder) -> None:  # one tensor read between releases
        reads.append(self.bytes_read)
        real_release(self)

    monkeypatch.setattr(hf_io.SafetensorsFolder, "release", release)
    ckpt = next((tmp_path / "ckpt").glob("step-*"))
    n = export.export(ckpt, tmp_path / "base", tmp_path / "merged", argv, merged=True)
    steps = [b - a for a, b in zip([0, *reads], reads)]
    biggest = max(v.numel() * v.element_size() for v in sd.values())
    assert n == len(steps) and max(steps) <= biggest, (max(steps), biggest)

    want = adapter.to_hf(merge_adapters(sd, cfg))
    got: dict[str, torch.Tensor] = {}
    for f in (tmp_path / "merged").glob("*.safetensors"):
        got.update(load_file(str(f)))
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    merged_adapters = [k for k in sd if k.endswith(("lora_A", "lora_A_w1"))]
    assert merged_adapters, "the case must fold some adapters in"
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert config == json.loads((tmp_path / "base" / "config.json").read_text())


def test_peft_export_reads_no_base_weights(tmp_path: Path) -> None:
    _, argv, sd, _ = _setup("llama3", tmp_path)
    for f in (tmp_path / "base").glob("*.safetensors"):
        f.write_bytes(b"not read")  # a read of the base's weights would fail
    export = load("scripts/export_lora.py")
    ckpt = next((tmp_path / "ckpt").glob("step-*"))
    n = export.export(ckpt, tmp_path / "base", tmp_path / "peft", argv, merged=False)
    assert n == sum(is_adapter_name(k) for k in sd)
