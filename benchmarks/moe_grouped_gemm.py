"""The routed experts' two paths (docs/moe.md): one grouped GEMM against the per-expert loop.

::

    python benchmarks/moe_grouped_gemm.py                      # this machine's accelerator, else CPU
    python benchmarks/moe_grouped_gemm.py --experts 8 --rows 16384 --dim 2048 --hidden 1408

Builds the shared ``Experts`` (SwiGLU, stacked ``[E, ...]`` weights), routes ``--rows`` rows to
the experts at random (nearly even counts, as a balanced router gives) and times forward and
backward of each path over ``--steps`` iterations after ``--warmup`` (device synchronized at
both ends). Prints one JSON line: milliseconds and TFLOP/s of each path (3 matmuls forward, 6
backward), whether ``torch._grouped_mm`` is supported here (``grouped_mm_supported``), and the
largest difference between the paths' outputs and the relative difference of a weight's
gradient (0 where both run the same kernels' arithmetic). Defaults: bf16 on an accelerator (the
training dtype), fp32 and a small shape on CPU.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from torchtitan.distributed.utils import device_type
from torchtitan.models.common.moe_experts import Experts, grouped_mm_supported


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize()


def _inputs(args: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(1)
    expert = torch.randint(args.experts, (args.rows,), generator=gen)
    counts = torch.bincount(expert, minlength=args.experts).to(device)
    x = torch.randn(args.rows, args.dim, generator=gen).to(device, dtype)
    return x, counts


def time_path(
    experts: Experts, x: torch.Tensor, counts: torch.Tensor, grouped: bool, args: argparse.Namespace
) -> tuple[float, torch.Tensor, torch.Tensor]:
    """Milliseconds per forward + backward, the last output and the last gradient of ``w1``."""
    experts.use_grouped_mm = grouped
    rows = x.clone().requires_grad_()
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            _sync(x.device)
            t0 = time.perf_counter()
        experts.zero_grad(set_to_none=True)
        out = experts(rows, counts)
        out.float().square().mean().backward()
    _sync(x.device)
    ms = (time.perf_counter() - t0) / args.steps * 1e3
    assert experts.w1.grad is not None
    return ms, out.detach().float(), experts.w1.grad.float()


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default=device_type(), help="default: detected")
    p.add_argument("--dtype", default="", help="bfloat16 or float32 (default: bf16 off CPU)")
    p.add_argument("--experts", type=int, default=0, help="default 8 (4 on CPU)")
    p.add_argument("--rows", type=int, default=0, help="routed rows (default 16384; 512 on CPU)")
    p.add_argument("--dim", type=int, default=0, help="default 2048 (128 on CPU)")
    p.add_argument("--hidden", type=int, default=0, help="default 1408 (64 on CPU)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    big = device.type != "cpu"
    dtype = getattr(torch, args.dtype or ("bfloat16" if big else "float32"))
    for name, gpu, cpu in (("experts", 8, 4), ("rows", 16384, 512), ("dim", 2048, 128), ("hidden", 1408, 64)):  # fmt: skip
        setattr(args, name, getattr(args, name) or (gpu if big else cpu))
    torch.manual_seed(0)
    experts = Experts(args.experts, args.dim, args.hidden).to(device, dtype)
    for w in experts.parameters():
        torch.nn.init.normal_(w, std=0.02)
    x, counts = _inputs(args, device, dtype)
    flops = 9 * 2 * args.rows * args.dim * args.hidden  # 3 matmuls, forward and 2x backward
    result: dict = {"device": str(device), "dtype": str(dtype).removeprefix("torch.")}
    result["grouped_mm_supported"] = grouped_mm_supported(device.type, dtype)
    paths = [False] + ([True] if result["grouped_mm_supported"] else [])
    measured = {grouped: time_path(experts, x, counts, grouped, args) for grouped in paths}
    for grouped, (ms, _, _) in measured.items():
        key = "grouped" if grouped else "loop"
        result[key] = {"ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 2)}
    if len(measured) == 2:
        (_, y0, g0), (_, y1, g1) = measured[False], measured[True]
        result["max_abs_diff_out"] = (y1 - y0).abs().max().item()
        result["rel_diff_w1_grad"] = ((g1 - g0).norm() / g0.norm()).item()
        result["speedup"] = round(measured[False][0] / measured[True][0], 2)
    result["shape"] = {k: getattr(args, k) for k in ("experts", "rows", "dim", "hidden")}
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
