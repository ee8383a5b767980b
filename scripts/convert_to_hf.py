"""Export the model weights of a DCP checkpoint as a Hugging Face Llama folder.

    python scripts/convert_to_hf.py outputs/debug_model/checkpoint/step-60 hf_out \
        --flavor debugmodel [--dtype bfloat16] [--max_shard_size_mb 4096]

Writes ``config.json``, ``model-0000i-of-0000n.safetensors`` and
``model.safetensors.index.json``; ``transformers.LlamaForCausalLM.from_pretrained(hf_out)``
loads it. Runs in one process without a process group (any saved parallelism works). The
vocabulary size and the maximum sequence length come from the checkpoint (the trainer sets
them from the tokenizer and training.seq_len); the other shapes from the flavor.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

from torchtitan.checkpoint.storage import read_model_weights
from torchtitan.models.llama3 import llama3_spec
from torchtitan.models.llama3.args import LLAMA3_FLAVORS, ModelArgs

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def save_hf(
    hf: dict[str, torch.Tensor], config: dict, out: Path, max_shard_bytes: int = 4 << 30
) -> None:
    """Sharded safetensors + index + config.json (tensors kept in the given order)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in hf.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t.contiguous()
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in hf.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def convert(checkpoint: Path, out: Path, args: ModelArgs, dtype: torch.dtype, shard_mb: int) -> int:
    model = read_model_weights(checkpoint)
    args = dataclasses.replace(args, vocab_size=model["tok_embeddings.weight"].shape[0])
    adapter = llama3_spec.state_dict_adapter(args)
    hf = {k: v.to(dtype) for k, v in adapter.to_hf(model).items()}
    save_hf(hf, adapter.hf_config(dtype), out, max_shard_bytes=shard_mb << 20)
    return len(hf)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("checkpoint", type=Path, help="a step-N checkpoint folder")
    p.add_argument("output", type=Path, help="folder for the Hugging Face files")
    p.add_argument("--flavor", default="debugmodel", choices=sorted(LLAMA3_FLAVORS))
    p.add_argument("--dtype", default="float32", choices=sorted(_DTYPES))
    p.add_argument("--max_seq_len", type=int, default=None, help="max_position_embeddings")
    p.add_argument("--max_shard_size_mb", type=int, default=4096)
    a = p.parse_args(argv)
    args = LLAMA3_FLAVORS[a.flavor]
    if a.max_seq_len is not None:
        args = dataclasses.replace(args, max_seq_len=a.max_seq_len)
    n = convert(a.checkpoint, a.output, args, _DTYPES[a.dtype], a.max_shard_size_mb)
    print(f"wrote {n} tensors to {a.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
