"""Time and memory of one AdamW step against one Muon step at the Llama 3.2 1B shape (CPU).

::

    OMP_NUM_THREADS=2 python benchmarks/optimizer_step.py --layers 1 --steps 3

Builds the parameters of ``--layers`` blocks of the 1B shape (dim 2048, 32 query / 8 key-value
heads of 64, SwiGLU hidden 8192), gives them random gradients and times ``optimizer.step()`` for
AdamW (foreach) and for Muon (Newton-Schulz in fp32 on CPU, 5 iterations; AdamW for the norms).
Scaled down for a shared CPU: the embedding and head (vocabulary 128256: 0.5 G elements, 8 GiB
with gradients and AdamW state) are left out, since both optimizers step them with the same
AdamW; and the default measures one of the 16 blocks, the JSON scaling its time and state to 16
(Newton-Schulz costs O(m n min(m, n)) per matrix: tens of seconds per block on one thread).
Also printed: the optimizer-state bytes of each, and, per rank under FSDP over W
ranks, the bytes Muon's all-to-alls move per step (``optim/muon_dist.py``: twice the shard of
each sharded matrix times (W - 1) / W; AdamW moves nothing beyond FSDP's own collectives).
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch import nn

from torchtitan.config.job_config import Optimizer
from torchtitan.optim.optimizer import build_optimizer

DIM, HEADS, KV_HEADS, HEAD_DIM, HIDDEN, LAYERS = 2048, 32, 8, 64, 8192, 16


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
        for name, (o, i) in {
            "wq": (q, DIM), "wk": (kv, DIM), "wv": (kv, DIM), "wo": (DIM, q),
            "w1": (HIDDEN, DIM), "w2": (DIM, HIDDEN), "w3": (HIDDEN, DIM),
        }.items():  # fmt: skip
            setattr(self, name, nn.Linear(i, o, bias=False))
        self.attention_norm, self.ffn_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)


def _model(layers: int) -> nn.Module:
    m = nn.Module()
    m.layers = nn.ModuleList(_Block() for _ in range(layers))
    return m


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(
        t.numel() * t.element_size()
        for s in opt.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor) and t.ndim > 0
    )


def _bench(name: str, layers: int, steps: int) -> dict:
    torch.manual_seed(0)
    model = _model(layers)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    cfg = Optimizer(name=name, lr=1e-3, implementation="foreach", muon_ns_dtype="float32")  # type: ignore[arg-type]
    opt = build_optimizer([model], cfg)
    opt.step()  # the state is created here
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    muon_elems = sum(
        p.numel() for g in opt.param_groups if g.get("algorithm") == "muon" for p in g["params"]
    )
    return {"step_s": min(times), "state_bytes": _state_bytes(opt), "muon_elems": muon_elems}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    out: dict = {"layers_measured": args.layers, "threads": torch.get_num_threads()}
    scale = LAYERS / args.layers
    muon_elems = 0
    for name in ("AdamW", "Muon"):
        r = _bench(name, args.layers, args.steps)
        muon_elems = max(muon_elems, r["muon_elems"])
        out[name] = {
            "step_s": round(r["step_s"], 3),
            "step_s_16_blocks": round(r["step_s"] * scale, 2),
            "state_gib_16_blocks": round(r["state_bytes"] * scale / 2**30, 3),
        }
    muon_bytes = muon_elems * 4 * scale
    out["muon_all_to_all_mib_per_rank_16_blocks"] = {
        f"fsdp{w}": round(2 * muon_bytes / w * (w - 1) / w / 2**20, 1) for w in (2, 8, 64)
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
