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

import torch

from torchtitan.checkpoint.storage import read_hf_folder, read_model_weights
from torchtitan.config.manager import parse_args
from torchtitan.lora.peft_io import merge_adapters, save_peft_adapters
from torchtitan.models import MODELS


def export(ckpt: Path, base: Path, out: Path, config_argv: list[str], merged: bool) -> int:
    """Write the PEFT folder (or the merged HF folder); returns the number of tensors written."""
    from safetensors.torch import save_file

    cfg = parse_args(config_argv)
    spec = MODELS[cfg.model.name]
    assert spec.hf is not None, f"{cfg.model.name} has no Hugging Face mapping"
    config, hf_sd = read_hf_folder(base)
    adapter = spec.state_dict_adapter(spec.hf.config.args_from_hf(config))
    adapters = read_model_weights(ckpt)
    if not merged:
        return len(save_peft_adapters(out, adapters, adapter, cfg.lora, base=str(base)))
    full = {**adapter.from_hf(hf_sd), **adapters}
    hf = adapter.to_hf(merge_adapters(full, cfg.lora))
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in hf.items()}, str(out / "model.safetensors"))
    dtype = next(iter(hf_sd.values())).dtype
    (out / "config.json").write_text(json.dumps(adapter.hf_config(dtype), indent=2) + "\n")
    return len(hf)


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
