"""Expert-load metrics: per-layer min/max tokens and imbalance of the routing since the last log,
the mean auxiliary loss, counters reset at each log; the model.moe_* overrides."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from tests.tiny_args import tiny_qwen3
from torchtitan.models.common.moe import MoEArgs, moe_overrides
from torchtitan.models.common.moe_metrics import ExpertLoadMetrics
from torchtitan.models.qwen3 import Transformer

EXPERTS = MoEArgs(num_experts=4, top_k=2, expert_dim=16, aux_loss_coef=0.01)
ARGS = tiny_qwen3(32, (2, 1), 64, 64, max_seq_len=16, tie_word_embeddings=False, moe=EXPERTS)


def test_load_fields_and_reset() -> None:
    model = Transformer(ARGS)
    model.init_weights(seed=0)
    model.train()
    source = ExpertLoadMetrics([model], mesh=None)
    assert source and len(source.layers) == 2
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    model(tokens)
    model(tokens)
    layer0 = source.layers[0][1]
    load = layer0.load_since_log.clone()
    assert load.sum().item() == 2 * 2 * 8 * 2  # two forwards x 16 tokens x top-2
    fields, text = source()
    assert fields["moe/layers.0/max_tokens"] == load.max().item()
    assert fields["moe/layers.0/min_tokens"] == load.min().item()
    assert fields["moe/layers.0/imbalance"] == pytest.approx(load.max().item() / load.mean().item())
    assert fields["moe/imbalance_max"] >= fields["moe/layers.0/imbalance"]
    assert fields["moe/aux_loss"] == pytest.approx(0.02, rel=0.5)  # 2 layers x ~0.01 x ~1
    assert "moe imbalance" in text and "aux" in text
    assert not layer0.load_since_log.any() and not layer0.aux_since_log.any()
    model.eval()  # evaluation (validation) does not count
    model(tokens)
    assert not layer0.load_since_log.any()


def test_overrides() -> None:
    cfg = SimpleNamespace(moe_aux_loss_coef=0.0, moe_bias_update_rate=0.001)
    got = moe_overrides(ARGS, cfg)
    assert got.moe == dataclasses.replace(ARGS.moe, aux_loss_coef=0.0, bias_update_rate=0.001)
    keep = SimpleNamespace(moe_aux_loss_coef=-1.0, moe_bias_update_rate=-1.0)
    assert moe_overrides(ARGS, keep) is ARGS
