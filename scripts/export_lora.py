"""Export the LoRA adapters of a training checkpoint for the Hugging Face ecosystem (docs/lora.md).

    python scripts/export_lora.py outputs/lora_debug/checkpoint/step-40 outputs/hf_base peft_out \
        --job.config_file train_configs/lora_debug.toml [--lora.rank 16 ...] [--merged]

Writes ``adapter_config.json`` + ``adapter_model.safetensors`` (PEFT's format, transformers'
module names through the family's ``HFMapping``), which ``peft.PeftModel.from_pretrained``
loads on the base folder; with ``--merged`` a full Hugging Face folder of the base with the
adapters folded in. The adapter settings and the family come from the training config (the
same file and overrides as the run); the shapes from the base's ``config.json``. Runs in one
process without a process group.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from torchtitan.checkpoint.hf_io import SafetensorsFolder, base_state_dict, save_hf_streaming
from torchtitan.checkpoint.storage import read_model_weights
from torchtitan.config.job_config import Lora
from torchtitan.config.manager import parse_args
from torchtitan.lora.peft_io import merge_adapters, save_peft_adapters
from torchtitan.models import MODELS


def export(ckpt: Path, base: Path, out: Path, config_argv: list[str], merged: bool) -> int:
    """Write the PEFT folder (or the merged HF folder); returns the number of tensors written.
    The base's weights are never read whole: the PEFT export needs only its ``config.json``;
    the merged one streams it a tensor at a time (read, fold in its adapters, write)."""
    cfg = parse_args(config_argv)
    spec = MODELS[cfg.model.name]
    assert spec.hf is not None, f"{cfg.model.name} has no Hugging Face mapping"
    args = spec.hf.config.args_from_hf(json.loads((base / "config.json").read_text()))
    adapter = spec.state_dict_adapter(args)
    adapters = read_model_weights(ckpt)
    if not merged:
        return len(save_peft_adapters(out, adapters, adapter, cfg.lora, base=str(base)))
    return _export_merged(spec.build, args, adapter, adapters, cfg.lora, base, out)


def _export_merged(
    build: Any, args: Any, adapter: Any, adapters: dict, lora: Lora, base: Path, out: Path
) -> int:
    """The base folder with every adapter folded into its weight, one tensor in host memory at
    a time: names and shapes from the model built on ``meta``, each weight read from ``base``
    when it is written (``save_hf_streaming``'s ``fetch``)."""
    with torch.device("meta"):
        model = build(args)
    source = SafetensorsFolder(base)
    dtype = source.dtype(source.names()[0])
    sd = {k: v.to(dtype) for k, v in base_state_dict([model]).items()}
    written = 0

    def fetch(key: str, t: torch.Tensor) -> torch.Tensor:
        nonlocal written
        shape = tuple(t.shape)
        w = adapter.from_hf_box(key, shape, tuple(slice(0, n) for n in shape), source)
        source.release()
        written += 1
        return merge_adapters({key: w, **_adapters_of(key, adapters)}, lora)[key]

    try:
        save_hf_streaming(sd, adapter, out, dtype=dtype, fetch=fetch)
    finally:
        source.close()
    return written


def _adapters_of(key: str, adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter entries that fold into our tensor ``key``: ``m.lora_A``/``m.lora_B`` for
    ``m.weight``, ``m.lora_A_w1``/``m.lora_B_w1`` for grouped experts' ``m.w1``."""
    module, _, leaf = key.rpartition(".")
    suffix = "" if leaf == "weight" else f"_{leaf}"
    names = (f"{module}.lora_A{suffix}", f"{module}.lora_B{suffix}")
    return {n: adapters[n] for n in names if n in adapters}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("checkpoint", type=Path, help="a step-N checkpoint folder of a LoRA run")
    p.add_argument("base", type=Path, help="the Hugging Face base folder the run started from")
    p.add_argument("output", type=Path, help="folder for the PEFT (or merged HF) files")
    p.add_argument("--merged", action="store_true", help="write base + adapters as HF weights")
    known, config_argv = p.parse_known_args(argv)
    with torch.no_grad():
        n = export(known.checkpoint, known.base, known.output, config_argv, known.merged)
    print(f"wrote {n} tensors to {known.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
