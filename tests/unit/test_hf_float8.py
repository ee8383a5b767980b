"""float8 on an ``hf`` family model (docs/hf_models.md, docs/float8.md): the trainer's meta
build converts transformers' linears (emulated on CPU) while the default ``filter_fqns``
(``["output"]``) keeps the family's head, ``lm_head`` (its plan's ``head``), in high
precision; a forward/backward then trains."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.hf_models import save_config
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models import MODELS, run_args
from torchtitan.preflight.validate import load_config
from torchtitan.training.builders import build_meta_model

VOCAB = 2048
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_float8_converts_the_hf_linears_but_not_lm_head(tmp_path: Path) -> None:
    folder = save_config("mistral", tmp_path / "m")
    argv = ["--model.name", "hf", "--model.flavor", str(folder), "--training.seq_len", "32"]
    f8 = ["--quantize.dense.float8.enable", "--no-quantize.dense.float8.auto_filter_small_kn"]
    cfg = load_config([*argv, *f8], world_size=1)
    assert cfg.quantize.dense.float8.filter_fqns == ["output"]  # the default, untouched
    spec = MODELS["hf"]
    args = run_args(cfg, VOCAB)
    assert spec.parallel_plan(args).head == "lm_head"
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, world_size=1)
    model = build_meta_model(cfg, spec, args, dims, torch.device("cpu"))
    kinds = {n: type(m).__name__ for n, m in model.named_modules() if n.endswith(LINEARS)}
    converted = sorted(n for n, k in kinds.items() if k == "Float8Linear")
    assert len(converted) == len(LINEARS) * args.n_layers == len(kinds), kinds
    assert type(model.lm_head).__name__ == "Linear"

    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    tokens = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(3):
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        q = model.get_submodule("model.layers.0.self_attn.q_proj")
        assert q.weight.grad is not None and q.weight.grad.abs().sum() > 0
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
