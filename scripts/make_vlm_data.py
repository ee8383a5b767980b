"""Write tiny image-text shards for tests and the vision-language debug run (docs/vlm.md):
``vlm.parquet`` (columns ``text`` and ``images``, a list of PNG bytes per row) and
``vlm-000.tar`` (WebDataset layout: ``<key>.txt`` with ``<key>.<i>.png``), from a seed::

    python scripts/make_vlm_data.py --output /tmp/vlm --samples 16

Each sample has one or two random images of 24-80 pixels a side and a caption naming their
mean colour, with an ``<image>`` marker per image (``--text-only-every k``: every k-th sample
has no image). ``--bad`` adds a corrupt image, an oversized
one (``--oversized`` pixels a side) and a row with more markers than images, each in its own
sample, at the end of the parquet.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

COLOURS = {"red": (200, 30, 30), "green": (30, 180, 30), "blue": (30, 30, 200)}


def png(rng: random.Random, side: tuple[int, int] | None = None) -> tuple[bytes, str]:
    name = rng.choice(sorted(COLOURS))
    h, w = side or (rng.randint(24, 80), rng.randint(24, 80))
    noise = np.random.default_rng(rng.randint(0, 2**31)).integers(0, 40, (h, w, 3))
    pixels = np.clip(np.array(COLOURS[name]) + noise, 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue(), name


def samples(n: int, seed: int, text_only_every: int = 0) -> list[tuple[str, list[bytes]]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        images = [png(rng) for _ in range(rng.randint(1, 2))]
        if text_only_every and i % text_only_every == text_only_every - 1:
            images = []
        text = " ".join(f"{'<image>'} a {c} picture." for _, c in images)
        text = text or "No picture here, only words."
        out.append((f"Look: {text} The end.", [b for b, _ in images]))
    return out


def write(
    folder: Path, n: int, seed: int, bad: bool, oversized: int, text_only_every: int = 0
) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    rows = samples(n, seed, text_only_every)
    with tarfile.open(folder / "vlm-000.tar", "w") as tar:
        for i, (text, images) in enumerate(rows):
            members = {f"{i:06d}.txt": text.encode()}
            members.update({f"{i:06d}.{j}.png": b for j, b in enumerate(images)})
            for name, data in members.items():
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    if bad:
        big, _ = png(random.Random(seed), (oversized, oversized))
        rows += [
            ("corrupt: <image> end.", [b"\x89PNG\r\n\x1a\nnot an image"]),
            ("oversized: <image> end.", [big]),
            ("two markers: <image> <image> one image.", [rows[0][1][0]]),
        ]
    table = pa.table({"text": [t for t, _ in rows], "images": [i for _, i in rows]})
    pq.write_table(table, folder / "vlm.parquet")
    (folder / "README.json").write_text(json.dumps({"samples": n, "seed": seed, "bad": bad}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bad", action="store_true")
    parser.add_argument("--oversized", type=int, default=400)
    parser.add_argument("--text-only-every", type=int, default=0)
    args = parser.parse_args()
    write(args.output, args.samples, args.seed, args.bad, args.oversized, args.text_only_every)


if __name__ == "__main__":
    main()
