"""Attention time of causal vs block-causal (document) masking, forward + backward.

    python benchmarks/attention_mask.py                  # seq 2048, CPU (the exact SDPA path)
    python benchmarks/attention_mask.py --seq_len 8192 --device cuda   # also times flex

Random ``q, k, v`` of ``[batch, heads, seq_len, head_dim]`` (fp32 on CPU, bf16 on CUDA) and a
window packed with documents of ``--min_doc``..``--max_doc`` tokens (seeded). Kernels, each
through ``models/common/attention.py: AttentionCore``:

* ``sdpa_causal``: SDPA ``is_causal=True`` (what ``attn_mask_type = causal`` runs);
* ``sdpa_block_causal``: SDPA with the dense boolean document mask (the exact CPU path);
* ``flex_block_causal`` (CUDA only): compiled FlexAttention with the ``BlockMask``.

The mask is built inside the timed region, once per iteration, as the model builds it once per
batch. Prints one JSON line: median milliseconds per forward + backward for each kernel.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchtitan.models.common.attention import AttentionCore, build_attention_mask  # noqa: E402


def packed_doc_ids(seq_len: int, lo: int, hi: int, seed: int = 0) -> torch.Tensor:
    """``[1, seq_len]`` int32 document ids of a window packed with documents of lo..hi tokens."""
    g = torch.Generator().manual_seed(seed)
    ids, doc = [], 0
    while len(ids) < seq_len:
        ids += [doc] * int(torch.randint(lo, hi + 1, (1,), generator=g))
        doc += 1
    return torch.tensor([ids[:seq_len]], dtype=torch.int32)


def time_kernel(run, iters: int, warmup: int, device: str) -> float:  # type: ignore[no-untyped-def]
    times = []
    for i in range(warmup + iters):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq_len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head_dim", type=int, default=64)
    p.add_argument("--min_doc", type=int, default=200)
    p.add_argument("--max_doc", type=int, default=2000)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="cpu")
    a = p.parse_args(argv)
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    shape = (a.batch, a.heads, a.seq_len, a.head_dim)
    q, k, v = (torch.randn(shape, device=a.device, dtype=dtype, requires_grad=True) for _ in "qkv")
    ids = packed_doc_ids(a.seq_len, a.min_doc, a.max_doc).expand(a.batch, -1).to(a.device)
    core = AttentionCore()

    def run(backend: str | None):  # type: ignore[no-untyped-def]
        def step() -> None:
            mask = None if backend is None else build_attention_mask(ids, backend)
            core(q, k, v, mask).sum().backward()

        return step

    kernels = {"sdpa_causal": run(None), "sdpa_block_causal": run("sdpa")}
    if a.device == "cuda":
        kernels["flex_block_causal"] = run("flex")
    result: dict = {
        "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "shape": list(shape),
        "documents": int(ids.max()) + 1,
    }
    for name, fn in kernels.items():
        result[f"{name}_ms"] = round(time_kernel(fn, a.iters, a.warmup, a.device), 2)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
