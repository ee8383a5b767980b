"""Qwen3.5's delta rule (docs/qwen3_5.md): flash-linear-attention's chunked kernel against the
exact PyTorch chunked form, forward + backward, on one device; one JSON line.

    python benchmarks/delta_rule.py            # CUDA, 9B shape: 32 value heads of 128, 8k tokens
    python benchmarks/delta_rule.py --small    # a CPU-sized case (the chunked form alone)

``max_rel_diff``: the two kernels' outputs (bf16 inputs on CUDA) relative to the largest
output value; ``speedup``: chunked ms / fla ms.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from torchtitan.models.qwen3_5.delta_rule import chunked_delta_rule, fla_available, fla_delta_rule


def _inputs(b: int, s: int, h: int, d: int, device: str, dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(0)
    q = F.normalize(torch.randn(b, s, h, d, device=device, generator=gen), dim=-1) * d**-0.5
    k = F.normalize(torch.randn(b, s, h, d, device=device, generator=gen), dim=-1)
    v = torch.randn(b, s, h, d, device=device, generator=gen)
    g = -F.softplus(torch.randn(b, s, h, device=device, generator=gen))
    beta = torch.rand(b, s, h, device=device, generator=gen)
    return [t.to(dtype).requires_grad_() for t in (q, k, v, g, beta)]


def _time(fn, inputs: list[torch.Tensor], steps: int) -> tuple[float, torch.Tensor]:  # type: ignore[no-untyped-def]
    out = fn(*inputs)
    for _ in range(2):
        fn(*inputs).float().square().sum().backward()
    if inputs[0].is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        fn(*inputs).float().square().sum().backward()
    if inputs[0].is_cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps * 1e3, out.detach().float()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="a CPU-sized case")
    p.add_argument("--steps", type=int, default=10)
    a = p.parse_args()
    cuda = torch.cuda.is_available() and not a.small
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    b, s, h, d = (1, 8192, 32, 128) if cuda else (1, 256, 4, 32)
    inputs = _inputs(b, s, h, d, device, dtype)
    chunked_ms, ref = _time(chunked_delta_rule, inputs, a.steps)
    row: dict[str, object] = {"device": device, "shape": [b, s, h, d], "dtype": str(dtype)}
    row["chunked_ms"] = round(chunked_ms, 3)
    if cuda and fla_available():
        fla_ms, out = _time(fla_delta_rule, inputs, a.steps)
        row["fla_ms"] = round(fla_ms, 3)
        row["speedup"] = round(chunked_ms / fla_ms, 2)
        row["max_rel_diff"] = ((out - ref).abs().max() / ref.abs().max()).item()
    print(json.dumps(row))


if __name__ == "__main__":
    main()
