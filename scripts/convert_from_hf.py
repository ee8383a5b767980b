"""Import Hugging Face Llama weights as a model-only DCP checkpoint.

    python scripts/convert_from_hf.py hf_folder outputs/imported/checkpoint --step 0

Reads ``config.json`` and the ``*.safetensors`` files (sharded or not), converts names and the
RoPE layout (torchtitan/models/llama3/hf.py) and writes
``<output>/step-<step>/`` with a manifest, holding only ``model``. Prints the matching model
arguments so you can check them against the flavor you train with.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from torchtitan.checkpoint.storage import read_hf_folder, write_model_weights
from torchtitan.models.llama3 import llama3_spec
from torchtitan.models.llama3.hf import args_from_hf_config


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("hf_folder", type=Path)
    p.add_argument("output", type=Path, help="checkpoint root; step-<step> is created in it")
    p.add_argument("--step", type=int, default=0)
    a = p.parse_args(argv)
    config, hf = read_hf_folder(a.hf_folder)
    args = args_from_hf_config(config)
    model = llama3_spec.state_dict_adapter(args).from_hf(hf)
    path = write_model_weights(a.output, a.step, model)
    print(f"wrote {len(model)} tensors to {path}; model args: {args}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
