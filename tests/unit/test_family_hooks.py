"""Family hooks declared in the spec (``FamilyHooks``, models/spec.py; docs/architecture.md,
"Adding a family hook"): every family with MoE flavors declares the MoE hooks, and the hooks do
what the trainer did inline before (the auxiliary loss's gradient seed, the expert-load and MTP
metrics, the routing-bias update)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.tiny_args import tiny_deepseek_v3, tiny_qwen3
from torchtitan.models import MODELS
from torchtitan.models.common.moe import MoE, MoEArgs, update_expert_bias
from torchtitan.models.common.moe_hooks import MOE_HOOKS, seed_aux_loss
from torchtitan.models.deepseek_v3 import Transformer as DeepSeekV3
from torchtitan.models.deepseek_v3.mtp import DEEPSEEK_V3_HOOKS
from torchtitan.models.qwen3 import Transformer as Qwen3
from torchtitan.models.spec import NO_HOOKS, batch_inputs, buffer_init

EXPERTS = MoEArgs(num_experts=4, top_k=2, expert_dim=16, bias_update_rate=0.01)


def _train_forward(model: torch.nn.Module, seed: int = 0) -> torch.Tensor:
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(seed))
    logits = model(tokens, **batch_inputs(model, tokens))
    loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())
    loss.backward()
    return tokens


@pytest.mark.parametrize("name", sorted(n for n in MODELS if n != "hf"))
def test_a_family_with_moe_flavors_declares_the_moe_hooks(name: str) -> None:
    """A family that forgot ``hooks=MOE_HOOKS`` would train its routers' bias never updated."""
    spec = MODELS[name]
    has_moe = any(getattr(args, "moe", None) is not None for args in spec.flavors.values())
    hooks = spec.hooks
    if has_moe:
        assert hooks.after_build is seed_aux_loss
        assert hooks.after_optimizer_step is update_expert_bias
    else:
        assert hooks is NO_HOOKS


def test_moe_hooks_seed_measure_and_update_a_qwen3_moe_model() -> None:
    args = tiny_qwen3(32, (2, 1), 64, 64, max_seq_len=16, tie_word_embeddings=False, moe=EXPERTS)
    model = Qwen3(args)
    model.init_weights(seed=0)
    model.train()
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    assert len(layers) == 2
    MOE_HOOKS.after_build([model], 6)  # e.g. 3 accumulation steps x 2 pipeline microbatches
    assert all(m.aux_loss_scale == 1.0 / 6 for m in layers)
    (source,) = MOE_HOOKS.metrics_fields([model], None, None)
    _train_forward(model)
    load = layers[0].tokens_per_expert.clone()
    assert load.sum().item() == 2 * 8 * 2  # 16 tokens, top-2
    bias = layers[0].router.expert_bias.clone()
    MOE_HOOKS.after_optimizer_step([model], None)
    # the bias moved toward the underloaded experts: +rate where below the mean, -rate above
    step = layers[0].router.expert_bias - bias
    assert torch.equal(step.sign(), (load.mean() - load).sign())
    assert step.abs().max().item() == pytest.approx(0.01)
    assert not layers[0].tokens_per_expert.any()
    fields, _ = source()
    assert fields["moe/layers.0/max_tokens"] == load.max().item()


def test_moe_hooks_do_nothing_on_a_dense_model() -> None:
    model = Qwen3(tiny_qwen3(32, (2, 1), 64, 64, max_seq_len=16))
    assert MOE_HOOKS.metrics_fields([model], None, None) == []


def test_deepseek_v3_hooks_log_the_mtp_loss_of_the_forwards() -> None:
    model = DeepSeekV3(tiny_deepseek_v3(mtp_depth=1, mtp_loss_weight=0.3))
    model.init_weights(seed=3)
    model.train()
    sources = DEEPSEEK_V3_HOOKS.metrics_fields([model], None, None)
    assert len(sources) == 2  # expert load, then the MTP loss
    losses = []
    for seed in (0, 1):
        _train_forward(model, seed)
        losses.append(model.mtp_loss.item())
    fields, text = sources[1]()
    assert fields["mtp/loss"] == pytest.approx(sum(losses) / 2, rel=1e-6)
    assert text.startswith("  mtp ")
    assert DEEPSEEK_V3_HOOKS.after_optimizer_step is update_expert_bias


def test_optional_model_members_have_their_defaults() -> None:
    dense = Qwen3(tiny_qwen3(32, (2, 1), 64, 64, max_seq_len=16))
    tokens = torch.zeros(1, 4, dtype=torch.long)
    assert batch_inputs(dense, tokens) == {}
    assert buffer_init(dense) is not None
    assert buffer_init(torch.nn.Linear(2, 2)) is None
    mtp = DeepSeekV3(tiny_deepseek_v3(mtp_depth=2))
    assert batch_inputs(mtp, tokens)["mtp_tokens"].shape == (1, 4, 3)
