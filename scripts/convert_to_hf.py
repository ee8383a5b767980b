"""Export the model weights of a DCP checkpoint as a sharded Hugging Face folder: an alias of
``python -m torchtitan.convert to-hf`` (every family; docs/hf_io.md) whose ``--model`` defaults
to llama3 and ``--flavor`` to debugmodel.

    python scripts/convert_to_hf.py outputs/debug_model/checkpoint/step-60 hf_out \
        [--model llama3] [--flavor debugmodel] [--dtype bfloat16] [--max-shard-gb 5]
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from torchtitan.convert import main as convert_main
from torchtitan.convert import to_hf


def convert(
    checkpoint: Path, out: Path, args: Any, dtype: torch.dtype, shard_mb: int, model: str = "llama3"
) -> int:
    """``to_hf`` with the shard size in MiB (the signature the tests and notebooks use)."""
    return to_hf(checkpoint, out, model, args, dtype, max_shard_bytes=shard_mb << 20)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    defaults = {"--model": "llama3", "--flavor": "debugmodel"}
    argv += [x for k, v in defaults.items() if k not in argv for x in (k, v)]
    return convert_main(["to-hf", *argv])


if __name__ == "__main__":
    sys.exit(main())
