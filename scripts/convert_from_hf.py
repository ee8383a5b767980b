"""Import a Hugging Face folder as a model-only DCP checkpoint: an alias of
``python -m torchtitan.convert from-hf`` (every family; docs/hf_io.md) whose ``--model``
defaults to llama3.

    python scripts/convert_from_hf.py hf_folder outputs/imported/checkpoint --step 0 [--model qwen3]
"""

from __future__ import annotations

import sys

from torchtitan.convert import main as convert_main


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--model" not in argv:
        argv += ["--model", "llama3"]
    return convert_main(["from-hf", *argv])


if __name__ == "__main__":
    sys.exit(main())
