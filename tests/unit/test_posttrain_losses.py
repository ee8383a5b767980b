"""Our DPO / SimPO / GRPO losses against TRL itself (docs/posttrain.md).

DPO: on the same tiny Llama (ours, exported to transformers) and the same batch of two pairs,
our ``DpoStep`` (one forward of chosen + rejected, the reference as frozen shards swapped in)
gives TRL ``DPOTrainer._compute_loss``'s loss (policy and a *different* reference model) and
every parameter's gradient to 1e-5, for each loss type. SimPO: ``CPOTrainer.cpo_loss`` on the
same length-averaged log-probs. GRPO: ``GRPOTrainer._compute_loss`` on the same per-token
log-probs, advantages, old and reference log-probs to 1e-6, for every averaging and with KL.
TRL's methods are called on a stand-in ``self`` holding exactly the attributes they read.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.hf_parity import export_hf
from tests.tiny_args import tiny_llama3
from torchtitan.loss.cross_entropy import IGNORE_INDEX
from torchtitan.models import MODELS
from torchtitan.posttrain.dpo import DpoSettings, DpoStep
from torchtitan.posttrain.losses import clip_fraction, dpo_losses, group_advantages, grpo_loss
from torchtitan.posttrain.reference import Reference

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")

ARGS = tiny_llama3(dim=64, heads=(4, 2), vocab=256)
# Two pairs: (prompt length, chosen length, rejected length); right padding to S.
S = 14
SHAPES = [(4, 6, 3), (6, 2, 7)]


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids [4, S] (chosen rows, then rejected) and the completion mask."""
    g = torch.Generator().manual_seed(1)
    ids = torch.zeros(4, S, dtype=torch.long)
    mask = torch.zeros(4, S, dtype=torch.long)
    attn = torch.zeros(4, S, dtype=torch.long)
    for i, (p, c, r) in enumerate(SHAPES):
        prompt = torch.randint(1, 256, (p,), generator=g)
        for row, n in ((i, c), (i + 2, r)):
            ids[row, :p] = prompt
            ids[row, p : p + n] = torch.randint(1, 256, (n,), generator=g)
            mask[row, p : p + n] = 1
            attn[row, : p + n] = 1
    return ids, mask, attn


def _ours(seed: int) -> torch.nn.Module:
    m = MODELS["llama3"].build(ARGS)
    m.init_weights(seed)
    return m


def _hf(model: torch.nn.Module, folder: Path) -> Any:
    from trl.trainer.utils import add_fused_lm_head

    folder.mkdir()
    export_hf(model, MODELS["llama3"].state_dict_adapter(ARGS), folder)
    hf = transformers.LlamaForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    )
    outputs = ("log_probs", "entropy", "mean_logits", "is_top1")
    add_fused_lm_head(hf, outputs=outputs)
    return hf


def _trl_self(policy: Any, ref: Any, loss_type: str, beta: float, smoothing: float) -> Any:
    acc = SimpleNamespace(
        device=torch.device("cpu"),
        gather_for_metrics=lambda t: t,
        gather=lambda t: t,
        reduce=lambda t, **_: t,
    )
    return SimpleNamespace(
        model=policy, ref_model=ref, accelerator=acc, aux_loss_enabled=False, ld_alpha=None,
        precompute_ref_logps=False, f_divergence_type="reverse_kl", loss_types=[loss_type],
        loss_weights=[1.0], beta=beta, label_smoothing=smoothing, use_weighting=False,
        _metrics=defaultdict(lambda: defaultdict(list)), _total_train_tokens=0, _tp_size=1,
        args=SimpleNamespace(gradient_checkpointing_kwargs=None),
    )  # fmt: skip


@pytest.mark.parametrize(
    "loss_type,beta,smoothing",
    [("sigmoid", 0.1, 0.0), ("hinge", 0.3, 0.0), ("ipo", 0.2, 0.0), ("robust", 0.1, 0.2)],
)
def test_dpo_loss_and_grads_equal_trl(
    tmp_path: Path, loss_type: str, beta: float, smoothing: float
) -> None:
    from trl import DPOTrainer

    policy, ref = _ours(0), _ours(7)
    hf, hf_ref = _hf(policy, tmp_path / "policy"), _hf(ref, tmp_path / "ref")
    ids, mask, attn = _batch()
    inputs = {"input_ids": ids, "attention_mask": attn, "completion_mask": mask}
    trl_loss = DPOTrainer._compute_loss(
        _trl_self(hf, hf_ref, loss_type, beta, smoothing), hf, inputs, False
    )
    trl_loss.backward()

    labels = ids[:, 1:].masked_fill(mask[:, 1:] == 0, IGNORE_INDEX)
    reference = Reference([policy])
    assert reference.frozen is not None
    reference.load_state_dict(dict(ref.state_dict()))
    step = DpoStep(
        [policy], torch.optim.SGD(policy.parameters(), lr=0.0), None,  # type: ignore[arg-type]
        DpoSettings(loss_type, beta, smoothing), reference, None, torch.device("cpu"),
    )  # fmt: skip
    x = ids[:, :-1]
    sums = step.forward_backward((x[:2], labels[:2], x[2:], labels[2:]), torch.tensor(0.5))
    ours_loss = sums[0] / 2
    assert abs(ours_loss.item() - trl_loss.item()) < 1e-5, (ours_loss.item(), trl_loss.item())
    grads = (
        MODELS["llama3"]
        .state_dict_adapter(ARGS)
        .to_hf({n: p.grad for n, p in policy.named_parameters()})
    )
    worst = max((grads[n] - p.grad).abs().max().item() for n, p in hf.named_parameters())
    assert worst < 1e-5, worst
    # the swap left the policy's weights as they were
    assert torch.equal(policy.state_dict()["norm.weight"], _ours(0).state_dict()["norm.weight"])


def test_dpo_rewards_are_beta_log_ratios() -> None:
    c, r, rc, rr = (torch.tensor([v]) for v in (-3.0, -5.0, -4.0, -4.5))
    s = dpo_losses(c, r, rc, rr, beta=0.5)
    assert torch.allclose(s.chosen_rewards, torch.tensor([0.5])) and torch.allclose(
        s.rejected_rewards, torch.tensor([-0.25])
    )


def test_simpo_equals_trl_cpo_loss() -> None:
    with warnings.catch_warnings():  # trl.experimental warns that its API may change
        warnings.simplefilter("ignore")
        from trl.experimental.cpo import CPOTrainer

    g = torch.Generator().manual_seed(0)
    chosen, rejected = -torch.rand(5, generator=g) * 20, -torch.rand(5, generator=g) * 20
    n_c, n_r = torch.tensor([3.0, 5, 7, 2, 9]), torch.tensor([4.0, 1, 6, 8, 3])
    for smoothing in (0.0, 0.1):
        me = SimpleNamespace(alpha=0.0, beta=2.0, simpo_gamma=0.7, label_smoothing=smoothing, loss_type="simpo",
                             accelerator=SimpleNamespace(device=torch.device("cpu")))  # fmt: skip
        trl_losses, trl_c, trl_r = CPOTrainer.cpo_loss(me, chosen / n_c, rejected / n_r)
        ours = dpo_losses(chosen, rejected, None, None, loss_type="simpo", beta=2.0, label_smoothing=smoothing,
                          chosen_tokens=n_c, rejected_tokens=n_r, simpo_gamma=0.7)  # fmt: skip
        assert torch.allclose(ours.losses, trl_losses, atol=1e-6, rtol=0)
        assert torch.allclose(ours.chosen_rewards, trl_c) and torch.allclose(
            ours.rejected_rewards, trl_r
        )


def _grpo_self(loss_type: str, beta: float, logps: torch.Tensor, max_len: int) -> Any:
    acc = SimpleNamespace(gather=lambda t: t, reduce=lambda t, **_: t, gather_for_metrics=lambda t: t,
                          num_processes=1, sync_gradients=True)  # fmt: skip
    ent = torch.zeros_like(logps)
    return SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, ent, None),
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token",
        beta=beta, loss_type=loss_type, epsilon_low=0.2, epsilon_high=0.28, use_vllm=False,
        args=SimpleNamespace(delta=None, use_bias_correction_kl=False), model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, _entropy_bonus_enabled=False, aux_loss_enabled=False,
        _metrics=defaultdict(lambda: defaultdict(list)), accelerator=acc, max_completion_length=max_len,
    )  # fmt: skip


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_grpo_loss_equals_trl(loss_type: str, beta: float) -> None:
    from trl import GRPOTrainer

    g = torch.Generator().manual_seed(3)
    B, T = 6, 9
    old = -torch.rand(B, T, generator=g) * 3
    logps = (old + torch.randn(B, T, generator=g) * 0.3).requires_grad_()
    ref = old + torch.randn(B, T, generator=g) * 0.2
    mask = (torch.arange(T) < torch.tensor([9, 4, 7, 1, 8, 5])[:, None]).long()
    adv = group_advantages(torch.tensor([1.0, 0, 1, 0, 0, 1]), k=3)
    inputs = {"prompt_ids": torch.zeros(B, 2, dtype=torch.long), "prompt_mask": torch.ones(B, 2),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask,
              "advantages": adv, "old_per_token_logps": old, "ref_per_token_logps": ref}  # fmt: skip
    me = _grpo_self(loss_type, beta, logps, T + 3)
    trl_loss = GRPOTrainer._compute_loss(me, None, inputs)
    (trl_grad,) = torch.autograd.grad(trl_loss, logps)
    out = grpo_loss(logps, old, adv, mask, ref_logps=ref, beta=beta, epsilon_low=0.2, epsilon_high=0.28,
                    loss_type=loss_type, max_completion_length=T + 3)  # fmt: skip
    (grad,) = torch.autograd.grad(out.loss, logps)
    assert abs(out.loss.item() - trl_loss.item()) < 1e-6
    assert (grad - trl_grad).abs().max().item() < 1e-6
    clip = clip_fraction(out.ratio.detach(), adv, mask, 0.2, 0.28).item()
    assert abs(clip - me._metrics["train"]["clip_ratio/region_mean"][0]) < 1e-6
    if beta:
        kl = ((out.kl * mask).sum() / mask.sum()).item()  # type: ignore[operator]
        assert abs(kl - me._metrics["train"]["kl"][0]) < 1e-6


def test_group_advantages_refuse_k1_and_centre() -> None:
    with pytest.raises(ValueError, match="k >= 2"):
        group_advantages(torch.tensor([1.0, 0.0]), k=1)
    adv = group_advantages(torch.tensor([1.0, 0, 0, 2, 2, 2]), k=3)
    assert torch.allclose(adv.view(2, 3).sum(1), torch.zeros(2), atol=1e-6)
    assert torch.equal(adv[3:], torch.zeros(3))  # a group of equal rewards teaches nothing


@pytest.mark.parametrize(
    "settings,rule",
    [
        (DpoSettings(beta=0.0), "dpo.beta = 0.0 must be > 0"),
        (DpoSettings("robust", label_smoothing=0.5), r"must lie in \[0, 0.5\)"),
        (
            DpoSettings("sigmoid", label_smoothing=0.1),
            "applies to loss_type 'robust' or 'simpo', not 'sigmoid'",
        ),
    ],
)
def test_dpo_settings_that_would_be_ignored_or_invalid_are_refused(
    settings: DpoSettings, rule: str
) -> None:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=rule):
        DpoStep([model], opt, None, settings, None, None, torch.device("cpu"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs a reference"):
        DpoStep([model], opt, None, DpoSettings(), None, None, torch.device("cpu"))  # type: ignore[arg-type]
