"""DeepSeek-V3: published sizes, the ModelSpec contract, YaRN, and equality with transformers'
DeepseekV3ForCausalLM through the state-dict adapter (fp32): logits both ways (max abs diff
<= 1e-5), the loss and every parameter's gradient after one backward (max relative diff <= 1e-4);
MTP against a reference written here from the tech report (section 2.2)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests import hf_parity
from tests.spec_checks import built_on_meta
from tests.tiny_args import tiny_deepseek_v3
from torchtitan.models.deepseek_v3 import DEEPSEEK_V3_FLAVORS, DeepSeekV3Args, Transformer
from torchtitan.models.deepseek_v3.hf import DEEPSEEK_V3_HF, DeepSeekV3Adapter

V3 = tiny_deepseek_v3()
# No query latent (V2-Lite), and a YaRN whose rotation magnitude is not 1 (mscale != all_dim).
LITE = tiny_deepseek_v3(q_lora_rank=0, rope_mscale=1.0, rope_mscale_all_dim=0.5)


@pytest.mark.parametrize(
    ("flavor", "total", "active"), [("16B", 15.71, 2.66), ("671B", 671.03, 37.55)]
)
def test_published_sizes(flavor: str, total: float, active: float) -> None:
    """Without the MTP module: DeepSeek-V2-Lite 15.7B (2.4B active + embedding), V3 671B/37B."""
    args = DEEPSEEK_V3_FLAVORS[flavor]
    main = args.num_params() - args.mtp_depth * args.mtp_params()
    act = args.num_params(active=True) - args.mtp_depth * args.mtp_params(active=True)
    assert main / 1e9 == pytest.approx(total, abs=0.01)
    assert act / 1e9 == pytest.approx(active, abs=0.35)


def test_spec_counts_and_plan_paths() -> None:
    spec, args, model, plan, blocks = built_on_meta("deepseek_v3", "debugmodel")
    dense, sparse = blocks["0"], blocks["1"]
    # Every style lands somewhere, except the direct query projection (a query latent here).
    for path in plan.tensor_parallel.root:
        alternative = path.endswith("attention.wq") or ".block.feed_forward" in path  # MoE block
        assert _has(model, path) or alternative, path
    for path in plan.tensor_parallel.block:
        assert _has(dense, path) or _has(sparse, path) or path == "attention.wq", path
    assert _has(dense, "feed_forward.w1") and _has(sparse, "moe") and not _has(dense, "moe")
    assert plan.context_parallel is not None
    dense.get_submodule(plan.context_parallel.attention_core)
    assert spec.flops_per_token(args, 2048) > 6 * args.num_params(exclude_embedding=True)


def _has(module: torch.nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True


def test_yarn_matches_transformers() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for args in (V3, LITE):
        config = transformers.DeepseekV3Config(
            **DeepSeekV3Adapter(DEEPSEEK_V3_HF, args).hf_config()
        )
        inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
        table = Transformer(args).freqs_cis
        pos = torch.arange(args.max_seq_len, dtype=torch.float32)
        ref = torch.polar(
            torch.full((1,), factor).expand(64, len(inv_freq)), torch.outer(pos, inv_freq)
        )
        assert (table - ref).abs().max() < 1e-5
        assert factor == pytest.approx(args.rope_attention_factor)


def _hf_model(args: DeepSeekV3Args, seed: int):
    transformers = pytest.importorskip("transformers")
    config = transformers.DeepseekV3Config(**DeepSeekV3Adapter(DEEPSEEK_V3_HF, args).hf_config())
    torch.manual_seed(seed)
    hf = transformers.DeepseekV3ForCausalLM(config)
    with torch.no_grad():  # random everything, the routing bias included
        for name, p in hf.named_parameters():
            p.copy_(
                1.0 + 0.3 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p)
            )
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    hf.config._attn_implementation = "eager"
    return hf


@pytest.mark.parametrize("args", [V3, LITE], ids=["v3", "lite"])
def test_import_matches_transformers_logits_loss_and_grads(
    args: DeepSeekV3Args, tmp_path: Path
) -> None:
    hf = _hf_model(args, seed=1)
    got, ours, hf_sd = hf_parity.import_hf(hf, tmp_path)
    assert (got.moe, got.q_lora_rank, got.rope_factor) == (
        args.moe,
        args.q_lora_rank,
        args.rope_factor,
    )
    tokens = hf_parity.tokens()
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    ours.train()
    hf.train()
    logits = ours(inputs)
    ref = hf(inputs).logits
    diff = (logits - ref).abs().max().item()
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    ref_loss = F.cross_entropy(ref.flatten(0, 1), labels.flatten())
    loss.backward()
    ref_loss.backward()
    print(
        f"transformers -> ours: max abs logit diff {diff:.2e}, loss {loss.item():.6f} vs {ref_loss.item():.6f}"
    )
    assert diff <= 1e-5, diff
    assert abs(loss.item() - ref_loss.item()) <= 1e-5
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    ref_grads = DeepSeekV3Adapter(DEEPSEEK_V3_HF, got).from_hf(hf_grads)
    worst, worst_name = 0.0, ""
    for name, p in ours.named_parameters():
        g, r = p.grad, ref_grads[name]
        rel = ((g - r).abs().max() / r.abs().max().clamp(min=1e-30)).item()
        if rel > worst:
            worst, worst_name = rel, name
    print(f"gradients: max relative diff {worst:.2e} ({worst_name})")
    assert worst <= 1e-4, (worst, worst_name)
    back = DeepSeekV3Adapter(DEEPSEEK_V3_HF, got).to_hf(dict(ours.state_dict()))
    per_expert = {k for k in back if ".mlp.experts." in k}
    assert set(back) - per_expert == {k for k in hf_sd if ".mlp.experts." not in k}
    assert all(torch.equal(back[k], hf_sd[k]) for k in set(back) - per_expert)


@pytest.mark.parametrize("args", [V3, LITE], ids=["v3", "lite"])
def test_export_matches_transformers_logits(args: DeepSeekV3Args, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    model = Transformer(args)
    model.init_weights(seed=3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
        for layer in (model.layers["1"], model.layers["2"]):
            assert layer.moe is not None
            layer.moe.router.expert_bias.normal_(0.0, 0.05)
    adapter = DeepSeekV3Adapter(DEEPSEEK_V3_HF, args)
    hf_class = transformers.DeepseekV3ForCausalLM
    diff = hf_parity.export_logit_diff(model, adapter, hf_class, tmp_path)
    print(f"ours -> transformers: max abs logit diff {diff:.2e}")
    assert diff <= 1e-5, diff


def _reference_mtp(
    model: Transformer, tokens: torch.Tensor, weight: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 tech report, section 2.2, written out on truncated sequences: module k at
    position i projects [RMSNorm(Emb(t_{i+k})); RMSNorm(h_i^{k-1})], runs its block, and the shared
    head predicts t_{i+k+1}; loss = weight / D * sum_k CE_k. Returns (main logits, MTP loss)."""
    seq = tokens.shape[1]
    h = model.tok_embeddings(tokens)
    for layer in model.layers.values():
        h = layer(h, model.freqs_cis[:seq])
    assert model.mtp is not None and model.norm is not None and model.output is not None
    main = model.output(model.norm(h))
    losses = []
    for k, module in enumerate(model.mtp.values(), start=1):
        n = seq - k - 1  # positions whose target t_{i+k+1} is inside the sequence
        emb = model.tok_embeddings(tokens[:, k : k + n])
        x = module.eh_proj(torch.cat([module.enorm(emb), module.hnorm(h[:, :n])], dim=-1))
        h = module.block(x, model.freqs_cis[:n])
        logits = model.output(module.norm(h))
        losses.append(F.cross_entropy(logits.flatten(0, 1), tokens[:, k + 1 : k + 1 + n].flatten()))
    return main, weight / len(losses) * torch.stack(losses).sum()


def test_mtp_matches_the_paper() -> None:
    """Two MTP depths: the loss the model attaches equals the reference, and so does every
    gradient of main loss + MTP loss."""
    args = tiny_deepseek_v3(mtp_depth=2, mtp_loss_weight=0.3)
    model = Transformer(args)
    model.init_weights(seed=5)
    ref_model = Transformer(args)
    ref_model.load_state_dict(model.state_dict())
    tokens = hf_parity.tokens()
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    logits = model(inputs)
    assert model.mtp_loss is not None
    F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    ref_logits, ref_mtp = _reference_mtp(ref_model, inputs, 0.3)
    (F.cross_entropy(ref_logits.flatten(0, 1), labels.flatten()) + ref_mtp).backward()
    print(f"MTP loss {0.3 * model.mtp_loss.item():.6f} vs reference {ref_mtp.item():.6f}")
    assert abs(0.3 * model.mtp_loss.item() - ref_mtp.item()) <= 1e-5
    ref_grads = dict(ref_model.named_parameters())
    worst, name = max(
        (((p.grad - ref_grads[n].grad).abs().max() / ref_grads[n].grad.abs().max()).item(), n)
        for n, p in model.named_parameters()
    )
    assert worst <= 1e-4, (worst, name)
    assert model.mtp["1"].eh_proj.weight.grad.abs().sum() > 0  # the second depth trains


# torch's CPU RMSNorm notes that bf16 rows with an fp32 weight skip its fused kernel.
@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight:UserWarning")
def test_mtp_trains_under_autocast() -> None:
    """Mixed precision without FSDP (the trainer's autocast, one GPU): the MTP block's MoE
    takes bf16 rows from its bf16 projection while its experts' weights stay fp32 (on an H100 this
    raised a dtype mismatch in ``torch._grouped_mm``). Loss and gradients stay near fp32's."""
    model = Transformer(tiny_deepseek_v3(mtp_depth=1, mtp_loss_weight=0.3))
    model.init_weights(seed=5)
    tokens = hf_parity.tokens()
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    losses, grads = [], []
    for enabled in (True, False):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        losses.append(loss.item() + 0.3 * model.mtp_loss.item())
        grads.append(model.mtp["0"].block.moe.experts.w1.grad.clone())
    print(f"loss bf16 autocast {losses[0]:.5f} vs fp32 {losses[1]:.5f}")
    assert abs(losses[0] - losses[1]) <= 2e-2 * losses[1]
    assert ((grads[0] - grads[1]).norm() / grads[1].norm()).item() <= 5e-2


def test_mtp_weight_zero_leaves_the_main_model_alone() -> None:
    """With weight 0 the main model's gradients equal a model without MTP."""
    with_mtp = Transformer(tiny_deepseek_v3(mtp_depth=1, mtp_loss_weight=0.0))
    with_mtp.init_weights(seed=2)
    without = Transformer(tiny_deepseek_v3())
    without.load_state_dict(
        {k: v for k, v in with_mtp.state_dict().items() if not k.startswith("mtp.")}
    )
    tokens = hf_parity.tokens()
    for model in (with_mtp, without):
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    grads = dict(without.named_parameters())
    for name, p in with_mtp.named_parameters():
        if not name.startswith("mtp."):
            assert torch.equal(p.grad, grads[name].grad), name


def test_mtp_hf_round_trip() -> None:
    """The MTP module exports as HF layer n_layers (the release's layout, with copies of the
    embedding and head) and comes back bit-identical."""
    args = tiny_deepseek_v3(mtp_depth=1)
    model = Transformer(args)
    model.init_weights(seed=4)
    adapter = DeepSeekV3Adapter(DEEPSEEK_V3_HF, args)
    hf = adapter.to_hf(dict(model.state_dict()))
    assert torch.equal(hf["model.layers.3.eh_proj.weight"], model.mtp["0"].eh_proj.weight)
    assert "model.layers.3.shared_head.head.weight" in hf and "model.layers.3.mlp.gate.weight" in hf
    back = adapter.from_hf(hf)
    sd = model.state_dict()
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    # A model built without MTP drops the release's MTP layer.
    plain = DeepSeekV3Adapter(DEEPSEEK_V3_HF, tiny_deepseek_v3()).from_hf(hf)
    assert not any(k.startswith("mtp.") for k in plain)


def test_estimates_count_mla_and_mtp(capsys: pytest.CaptureFixture[str]) -> None:
    """FLOPs, parameters and the generation cache of the 671B flavor by hand, and the planner
    finds a layout for the 16B config on 8 x 80 GiB."""
    from torchtitan.planner.__main__ import main as plan_main

    a = DEEPSEEK_V3_FLAVORS["671B"]
    mtp = 3 * 7168 + 2 * 7168 * 7168 + a._layer_params(61, active=False)
    assert a.num_params() - a.mtp_params() == a.num_params() - mtp
    attention = 6 * 62 * 128 * (192 + 128) * 4096
    head = 6 * 129280 * 7168
    assert a.flops_per_token(4096) == 6 * a.num_params(True, True) + attention + head
    assert a.kv_cache_bytes_per_token() == 61 * (512 + 64) * 2
    cfg = ["--job.config_file", "train_configs/deepseek_v3_16b.toml"]
    assert plan_main([*cfg, "--world_size", "8", "--device_memory_gib", "80", "--top", "1"]) == 0
    assert "expert_parallel_degree" in capsys.readouterr().out
