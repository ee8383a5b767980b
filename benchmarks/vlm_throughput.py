"""Throughput of vision-language training through the real trainer: images/s and tokens/s.

::

    python benchmarks/vlm_throughput.py --samples 64 --warmup 2 --steps 8 --threads 1 -- \\
        --training.seq_len 512 --training.local_batch_size 4

writes ``--samples`` seeded image-text samples (``scripts/make_vlm_data.py``: one or two images
of 24-80 pixels a side, resized by the processor's rules to at least 256 x 256, i.e. 64 merged
tokens each) into a temporary folder, measures their mean merged image tokens per sample
(``--training.image_tokens_per_sample``, so MFU counts the tower: docs/vlm.md, "Planning"),
and runs ``benchmarks/throughput.py: run_one`` on ``qwen3_5_vl debugmodel`` (overridable after
``--``) with ``training.dataset = "vlm"``. ``--text-weight W`` mixes the images with the
shipped text corpus's validation split at ``1 : W`` (``[[training.mixture]]``). Prints
throughput.py's JSON line plus ``images_per_s_per_device``, the images and patches per step
and the measured image tokens per sample.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "benchmarks"))

BASE = [
    "--job.config_file", str(ROOT / "train_configs" / "debug_model.toml"),
    "--model.name", "qwen3_5_vl", "--model.flavor", "debugmodel",
    "--training.seq_len", "512", "--training.local_batch_size", "4",
    "--checkpoint.no-enable", "--validation.no-enable", "--metrics.no-enable_tensorboard",
    "--metrics.log_freq", "1",
]  # fmt: skip


def image_tokens_per_sample(path: Path, seq_len: int) -> float:
    """Mean merged image tokens per sample of the ``vlm`` data at ``path``, as the trainer
    builds them for the debug flavor."""
    from torchtitan.data.rank_loader import image_rules
    from torchtitan.data.tokenizer import build_tokenizer
    from torchtitan.data.vlm_dataset import VLMDataset, image_tokens, source_files
    from torchtitan.models.qwen3_5_vl import QWEN35_VL_FLAVORS

    args = QWEN35_VL_FLAVORS["debugmodel"]
    tok = build_tokenizer(str(ROOT / "tests" / "assets" / "tokenizer"))
    data = VLMDataset(source_files(path), tok, seq_len, image_rules(args), image_tokens(args), 0, 1)
    counts = [int((s.inputs == args.image_token_id).sum()) for s in data]
    return sum(counts) / max(len(counts), 1)


def _mixture_toml(folder: Path, images: Path, text_weight: float) -> list[str]:
    text = ROOT / "tests" / "assets" / "test_corpus" / "validation.jsonl"
    path = folder / "mixture.toml"
    path.write_text(
        '[training]\ndataset = "mixture"\n'
        f'[[training.mixture]]\ndataset = "vlm"\npath = "{images}"\nweight = 1.0\n'
        f'[[training.mixture]]\npath = "{text}"\nweight = {text_weight}\n'
    )
    return ["--job.config_file", str(path)]


def main(argv: list[str] | None = None) -> int:
    from throughput import run_one

    from torchtitan.config.manager import split_overrides

    own, overrides = split_overrides(list(sys.argv[1:] if argv is None else argv))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--samples", type=int, default=64, help="image-text samples (default 64)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--steps", type=int, default=8, help="timed steps (default 8)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--text-weight", type=float, default=0.0, help="mix text at 1 : W (0: none)")
    p.add_argument("--label", default="vlm", help="name in the JSON line")
    args = p.parse_args(own)
    os.environ.setdefault("WANDB_MODE", "offline")
    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)
    import make_vlm_data

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        make_vlm_data.write(folder / "data", args.samples, 0, False, 400)
        images = folder / "data" / "vlm.parquet"
        seq_len = int(_last(BASE + overrides, "--training.seq_len"))
        per_sample = image_tokens_per_sample(images, seq_len)
        data = ["--training.dataset", "vlm", "--training.dataset_path", str(images)]
        if args.text_weight > 0:
            data = _mixture_toml(folder, images, args.text_weight)
            per_sample /= 1 + args.text_weight  # text rows carry none
        measured = ["--training.image_tokens_per_sample", str(round(per_sample))]
        dump = ["--job.dump_folder", str(folder / "out")]
        result = run_one([*BASE, *data, *measured, *dump, *overrides], args.warmup, args.steps,
                         args.label)  # fmt: skip
    if result is not None:
        result["image_tokens_per_sample_measured"] = round(per_sample, 2)
        print(json.dumps(result), flush=True)
    return 0


def _last(argv: list[str], flag: str) -> str:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag][-1]


if __name__ == "__main__":
    sys.exit(main())
