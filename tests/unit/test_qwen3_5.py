"""Qwen3.5 (dense and MoE): the delta-rule kernels against the definition, document masking,
published sizes, and one forward + backward equal to transformers' ``Qwen3_5ForCausalLM`` /
``Qwen3_5MoeForCausalLM`` through the state-dict adapter (fp32: logits and every gradient within
1e-5 relative), import and export both ways."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests import hf_parity
from tests.tiny_args import tiny_qwen3_5
from torchtitan.models import MODELS
from torchtitan.models.common.moe import MoE, MoEArgs
from torchtitan.models.qwen3_5 import QWEN35_FLAVORS, Qwen35Args, Qwen35Transformer
from torchtitan.models.qwen3_5.delta_rule import chunked_delta_rule, recurrent_delta_rule
from torchtitan.models.qwen3_5.hf import GroupedQKV

DENSE = tiny_qwen3_5()  # DeltaNet, attention, DeltaNet, attention; tied
MOE = tiny_qwen3_5(
    n_layers=2,
    tie_word_embeddings=False,
    moe=MoEArgs(num_experts=8, top_k=2, expert_dim=32),
    shared_expert_dim=48,
)


def _inputs(b: int = 2, s: int = 21, h: int = 3, dk: int = 8, dv: int = 6) -> tuple[Any, ...]:
    gen = torch.Generator().manual_seed(0)
    q = F.normalize(torch.randn(b, s, h, dk, generator=gen), dim=-1) * dk**-0.5
    k = F.normalize(torch.randn(b, s, h, dk, generator=gen), dim=-1)
    v = torch.randn(b, s, h, dv, generator=gen)
    g = -2 * torch.rand(b, s, h, generator=gen)
    beta = torch.rand(b, s, h, generator=gen)
    return q, k, v, g, beta


DOCS = torch.tensor([[0] * 5 + [1] * 9 + [2] * 7, [0] * 21])


@pytest.mark.parametrize("chunk", [4, 7, 64])
@pytest.mark.parametrize("docs", [None, DOCS], ids=["causal", "documents"])
def test_chunked_equals_recurrent(chunk: int, docs: torch.Tensor | None) -> None:
    """The chunked form (chunk boundaries inside and between documents) equals the definition,
    forward and every input's gradient (fp32)."""
    inputs = [t.clone().requires_grad_() for t in _inputs()]
    ref = recurrent_delta_rule(*inputs, doc_ids=docs)
    ref_grads = torch.autograd.grad(ref.square().sum(), inputs)
    out = chunked_delta_rule(*inputs, doc_ids=docs, chunk_size=chunk)
    grads = torch.autograd.grad(out.square().sum(), inputs)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_transformers_chunked_form_equals_ours() -> None:
    """transformers' own chunked delta rule (the reference model's) agrees with the definition
    here, so the two sides compute the same rule."""
    mod = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    q, k, v, g, beta = _inputs()
    theirs, _ = mod.torch_chunk_gated_delta_rule(q * 8**0.5, k, v, g, beta, chunk_size=4)
    torch.testing.assert_close(recurrent_delta_rule(q, k, v, g, beta), theirs, rtol=1e-5, atol=1e-6)


def test_documents_never_share_state() -> None:
    """With document ids, each packed document's output is what it gives alone."""
    q, k, v, g, beta = _inputs()
    packed = chunked_delta_rule(q, k, v, g, beta, doc_ids=DOCS, chunk_size=4)
    for start, stop in ((0, 5), (5, 14), (14, 21)):
        part = [t[:1, start:stop] for t in (q, k, v, g, beta)]
        alone = recurrent_delta_rule(*part)
        torch.testing.assert_close(packed[:1, start:stop], alone, rtol=1e-5, atol=1e-6)
    leaky = chunked_delta_rule(q, k, v, g, beta, chunk_size=4)  # without the ids: they mix
    assert (leaky[:1, 5:14] - packed[:1, 5:14]).abs().max() > 1e-3


def test_model_documents_equal_separate_sequences() -> None:
    """The whole model (convolution and recurrence reset, block-causal attention) on two packed
    documents gives each document's logits alone."""
    model = _model(DENSE, 1)
    tokens = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(3))
    doc_ids = torch.tensor([[0] * 8 + [1] * 12])
    from torchtitan.models.common.attention import document_positions

    with torch.no_grad():
        packed = model(tokens, positions=document_positions(doc_ids)[0], doc_ids=doc_ids)
        first, second = model(tokens[:, :8]), model(tokens[:, 8:])
    torch.testing.assert_close(packed, torch.cat([first, second], dim=1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("flavor", "total", "active"),
    [
        ("0.8B", 0.752, 0.752),
        ("9B", 8.954, 8.954),
        ("27B", 26.896, 26.896),
        ("35B-A3B", 34.661, 3.455),
        ("397B-A17B", 396.346, 17.349),
    ],
)
def test_published_sizes(flavor: str, total: float, active: float) -> None:
    args = QWEN35_FLAVORS[flavor]
    assert args.num_params() / 1e9 == pytest.approx(total, abs=0.001)
    assert args.num_params(active=True) / 1e9 == pytest.approx(active, abs=0.001)
    assert args.layer_types[:4] == ("linear_attention",) * 3 + ("full_attention",)


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_moe"])
def test_num_params_equals_built_module(flavor: str) -> None:
    args = QWEN35_FLAVORS[flavor]
    with torch.device("meta"):
        model = MODELS["qwen3_5"].build(args)
    assert sum(p.numel() for p in model.parameters()) == MODELS["qwen3_5"].num_params(args)
    kinds = {type(b.linear_attn or b.attention).__name__ for b in model.layers.values()}
    assert kinds == {"GatedDeltaNet", "GatedAttention"}


def test_grouped_qkv_permutation_round_trips_and_streams() -> None:
    """HF [Q | K | V] rows <-> ours grouped by key head, and any row box read alone."""
    t = GroupedQKV()
    w = torch.randn(DENSE.conv_dim, 5)
    hf = t.to_hf(w, DENSE)
    assert torch.equal(t.from_hf(hf, DENSE), w)
    nk, dk = DENSE.linear_num_key_heads, DENSE.linear_key_head_dim
    assert torch.equal(hf[:dk], w[:dk])  # key head 0's q rows lead both layouts
    assert torch.equal(hf[nk * dk : nk * dk + dk], w[dk : 2 * dk])  # its k rows
    for a, b in ((0, w.shape[0]), (3, 17), (10, 41), (w.shape[0] - 5, w.shape[0])):
        box = (slice(a, b), slice(1, 4))
        got = t.from_hf_box(lambda bx: hf[bx], box, tuple(w.shape), DENSE)
        assert torch.equal(got, w[box])
    conv = GroupedQKV(conv=True)
    cw = torch.randn(DENSE.conv_dim, 4)
    assert conv.to_hf(cw, DENSE).shape == (DENSE.conv_dim, 1, 4)
    assert torch.equal(conv.from_hf(conv.to_hf(cw, DENSE), DENSE), cw)
    got = conv.from_hf_box(
        lambda bx: conv.to_hf(cw, DENSE)[bx],
        (slice(5, 30), slice(0, 4)),
        (DENSE.conv_dim, 4),
        DENSE,
    )
    assert torch.equal(got, cw[5:30])


def _model(args: Qwen35Args, seed: int) -> Qwen35Transformer:
    model = Qwen35Transformer(args)
    model.init_weights(seed=seed)
    with torch.no_grad():  # non-trivial norms, decays and gates: a wrong mapping would show
        gen = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if p.dim() == 1 or "conv" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
    return model


def _hf_model(args: Qwen35Args) -> Any:
    transformers = pytest.importorskip("transformers")
    common = dict(
        vocab_size=args.vocab_size,
        hidden_size=args.dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads,
        head_dim=args.head_dim,
        layer_types=list(args.layer_types),
        linear_num_key_heads=args.linear_num_key_heads,
        linear_num_value_heads=args.linear_num_value_heads,
        linear_key_head_dim=args.linear_key_head_dim,
        linear_value_head_dim=args.linear_value_head_dim,
        max_position_embeddings=args.max_seq_len,
        tie_word_embeddings=args.tie_word_embeddings,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": args.rope_theta,
            "partial_rotary_factor": args.partial_rotary_factor,
        },
    )
    torch.manual_seed(5)
    if args.moe is None:
        config = transformers.Qwen3_5TextConfig(intermediate_size=args.intermediate_size, **common)
        model = transformers.Qwen3_5ForCausalLM(config)
    else:
        config = transformers.Qwen3_5MoeTextConfig(
            num_experts=args.moe.num_experts,
            num_experts_per_tok=args.moe.top_k,
            moe_intermediate_size=args.moe.expert_dim,
            shared_expert_intermediate_size=args.shared_expert_dim,
            **common,
        )
        model = transformers.Qwen3_5MoeForCausalLM(config)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(6)
        for name, p in model.named_parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
            if name.endswith("A_log"):  # slow decays: the state carries over many tokens
                p.copy_(torch.empty(p.shape).uniform_(0.05, 1.0, generator=gen).log())
    return model.float()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _forward_backward(ours: torch.nn.Module, hf: Any, adapter: Any) -> tuple[float, float]:
    """Max relative difference of the logits and of every gradient (HF's mapped to our names;
    the auxiliary loss off, transformers adds it only with labels)."""
    for m in ours.modules():
        if isinstance(m, MoE):
            m.args = dataclasses.replace(m.args, aux_loss_coef=0.0)
    tokens = hf_parity.tokens()[:, :24]
    ours_logits = ours(tokens)
    hf_logits = hf(tokens).logits
    ours_logits.square().mean().backward()
    hf_logits.square().mean().backward()
    hf_grads = adapter.from_hf({n: p.grad for n, p in hf.named_parameters()})
    worst = 0.0
    for name, p in ours.named_parameters():
        if name == "output.weight" and p is ours.tok_embeddings.weight:
            continue  # tied: the embedding's gradient holds both
        worst = max(worst, _rel(p.grad, hf_grads[name]))
    return _rel(ours_logits, hf_logits), worst


@pytest.mark.parametrize("args", [DENSE, MOE], ids=["dense", "moe"])
def test_import_from_transformers_forward_backward(args: Qwen35Args, tmp_path: Path) -> None:
    """A transformers model saved and read back (config.json -> our args, weights through the
    adapter): logits and every gradient within 1e-5 relative (fp32)."""
    hf = _hf_model(args)
    hf_args, ours, _ = hf_parity.import_hf(hf, tmp_path)
    assert hf_args.layer_types == args.layer_types
    assert hf_args.moe == (
        None if args.moe is None else dataclasses.replace(args.moe, aux_loss_coef=0.0)
    )
    ours = ours.float()
    hf.train()
    logits, grads = _forward_backward(ours, hf, MODELS["qwen3_5"].state_dict_adapter(hf_args))
    assert logits <= 1e-5, logits
    assert grads <= 1e-5, grads


@pytest.mark.parametrize("args", [DENSE, MOE], ids=["dense", "moe"])
def test_export_to_transformers(args: Qwen35Args, tmp_path: Path) -> None:
    """Ours written as a Hugging Face folder is read by transformers with the same logits, and
    the export round-trips bit for bit."""
    transformers = pytest.importorskip("transformers")
    model = _model(args, 2)
    adapter = MODELS["qwen3_5"].state_dict_adapter(args)
    cls = (
        transformers.Qwen3_5ForCausalLM if args.moe is None else transformers.Qwen3_5MoeForCausalLM
    )
    diff = hf_parity.export_logit_diff(model, adapter, cls, tmp_path)
    assert diff <= 1e-5, diff
    sd = dict(model.state_dict())
    back = adapter.from_hf(adapter.to_hf(sd))
    assert all(torch.equal(back[k], v) for k, v in sd.items())
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["layer_types"] == list(args.layer_types)


# ---------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"layer_types": ("linear_attention", "full_attention")}, "layer_types"),
        ({"layer_types": ("linear_attention",) * 3 + ("sliding",)}, "layer_types"),
        ({"linear_conv_kernel_dim": 0}, "linear_conv_kernel_dim"),
        ({"linear_num_value_heads": 5}, "linear_num_value_heads"),
    ],
)
def test_bad_config_is_one_line_naming_the_field(change: dict[str, Any], field: str) -> None:
    """From a Hugging Face config.json too: the field, the rule and the fix on one line."""
    from torchtitan.config.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        dataclasses.replace(DENSE, **change)
    assert err.value.field == field and "\n" not in str(err.value) and "Fix:" in str(err.value)
    hf_config = MODELS["qwen3_5"].state_dict_adapter(DENSE).hf_config()
    hf_config.update({k: list(v) if isinstance(v, tuple) else v for k, v in change.items()})
    with pytest.raises(ConfigError, match=field):
        MODELS["qwen3_5"].hf.config.args_from_hf(hf_config)


def test_tp_degree_must_divide_the_deltanet_heads() -> None:
    """The plan's divisible sizes name the DeltaNet heads; TP 3 is refused naming a head count."""
    from torchtitan.distributed.tensor_parallel import tp_problem

    plan = MODELS["qwen3_5"].parallel_plan(QWEN35_FLAVORS["debugmodel"])
    sizes = plan.tensor_parallel.divisible
    assert sizes["linear_num_key_heads"] == 4 and sizes["linear_num_value_heads"] == 8
    assert tp_problem(sizes, 2) is None
    problem = tp_problem({**sizes, "n_heads": 12, "n_kv_heads": 6}, 3)
    assert problem is not None and "linear_num_key_heads=4" in problem
    assert plan.context_parallel is not None and not plan.context_parallel.torch_ring
    # The recurrent and fla kernels have no entering state here: CP refused with the reason.
    for kernel in ("recurrent", "fla"):
        a = dataclasses.replace(QWEN35_FLAVORS["debugmodel"], linear_kernel=kernel)
        refused = MODELS["qwen3_5"].parallel_plan(a)
        assert refused.context_parallel is None
        assert "auto or chunked" in refused.refusals["context_parallel"]


def test_broken_fla_install_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """flash-linear-attention installed but failing to import: one line naming it, before any
    process group (preflight asks ``device_problem``); never on CPU with ``auto``."""
    from torchtitan.config.errors import ConfigError
    from torchtitan.models.qwen3_5 import args as args_module

    monkeypatch.setattr(args_module, "fla_available", lambda: True)
    monkeypatch.setattr(args_module, "fla_problem", lambda: "ImportError: triton missing")
    a = QWEN35_FLAVORS["debugmodel"]
    assert a.device_problem("cpu") is None
    problem = a.device_problem("cuda")
    assert isinstance(problem, ConfigError) and "triton missing" in str(problem)
    assert "\n" not in str(problem)
    forced = dataclasses.replace(a, linear_kernel="fla").device_problem("cpu")
    assert isinstance(forced, ConfigError) and "needs CUDA" in str(forced)


@pytest.mark.parametrize(
    "extra, words",
    [
        ((), None),
        (("--parallelism.context_parallel_method", "ring"), "linear attention"),
    ],
)
def test_cp_rules(tmp_path: Path, extra: tuple[str, ...], words: str | None) -> None:
    """Context parallel runs Qwen3.5 (docs/context_parallel.md); torch's causal ring (it
    patches only SDPA) is a one-line config error (exit 2 from the entry points)."""
    from tests.unit.test_estimator import BASE
    from torchtitan.config.errors import ConfigError
    from torchtitan.preflight.validate import load_config

    argv = [*BASE, "--model.name", "qwen3_5", "--job.dump_folder", str(tmp_path), *extra]
    argv += ["--parallelism.context_parallel_degree", "2"]
    if words is None:
        load_config(argv, world_size=2)
        return
    with pytest.raises(ConfigError, match=words) as e:
        load_config(argv, world_size=2)
    assert "\n" not in str(e.value)


class _Source:
    """An in-memory ``HFSource`` (``models/common/hf/mapping.py``) counting the bytes read."""

    def __init__(self, sd: dict[str, torch.Tensor]) -> None:
        self.sd, self.read_bytes = sd, 0

    def __contains__(self, name: object) -> bool:
        return name in self.sd

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.sd[name].shape)

    def read(self, name: str, box: Any) -> torch.Tensor:
        out = self.sd[name][box]
        self.read_bytes += out.numel() * out.element_size()
        return out


@pytest.mark.parametrize("args", [DENSE, MOE], ids=["dense", "moe"])
def test_streamed_import_reads_only_each_shard(args: Qwen35Args) -> None:
    """Every tensor's FSDP-style row shards (2 and 3 ranks) built by ``from_hf_box`` equal the
    whole import's rows, reading only the shard's bytes (docs/hf_io.md)."""
    adapter = MODELS["qwen3_5"].state_dict_adapter(args)
    ours = {k: v for k, v in _model(args, 3).state_dict().items()}
    whole = adapter.from_hf(adapter.to_hf(ours))
    for n in (2, 3):
        source = _Source(adapter.to_hf(ours))
        for key, full in whole.items():
            if key == "output.weight" and args.tie_word_embeddings:
                continue
            rows = -(-full.shape[0] // n)
            for r in range(n):
                box = (slice(min(r * rows, full.shape[0]), min((r + 1) * rows, full.shape[0])),)
                box += tuple(slice(0, s) for s in full.shape[1:])
                got = adapter.from_hf_box(key, tuple(full.shape), box, source)
                assert torch.equal(got, full[box]), (key, n, r)
        total = sum(
            v.numel() * v.element_size() for k, v in whole.items() if "expert_bias" not in k
        )
        if args.tie_word_embeddings:
            total -= whole["output.weight"].numel() * whole["output.weight"].element_size()
        assert source.read_bytes == total


def test_multimodal_checkpoint_text_decoder_is_read() -> None:
    """The published layout (``model.language_model.*``, a ``text_config``): streamed reads
    take the text decoder and never the vision tower; a whole state dict holding the vision
    tower is refused with one line naming it."""
    adapter = MODELS["qwen3_5"].state_dict_adapter(DENSE)
    ours = dict(_model(DENSE, 4).state_dict())
    text = adapter.to_hf(ours)
    multimodal = {k.replace("model.", "model.language_model.", 1): v for k, v in text.items()}
    multimodal["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(3, 3)
    source = _Source(multimodal)
    for key, full in ours.items():
        if key == "output.weight":
            continue  # tied
        box = tuple(slice(0, s) for s in full.shape)
        assert torch.equal(adapter.from_hf_box(key, tuple(full.shape), box, source), full), key
    with pytest.raises(ValueError, match="vision tower") as err:
        adapter.from_hf(multimodal)
    assert "\n" not in str(err.value)
    del multimodal["model.visual.blocks.0.attn.qkv.weight"]
    back = adapter.from_hf(multimodal)
    assert all(torch.equal(back[k], v) for k, v in ours.items())
    config = adapter.hf_config()
    wrapped = {"model_type": "qwen3_5", "tie_word_embeddings": True, "text_config": config}
    wrapped["text_config"] = {k: v for k, v in config.items() if k != "tie_word_embeddings"}
    assert MODELS["qwen3_5"].hf.config.args_from_hf(wrapped) == DENSE


@pytest.mark.gpu
@pytest.mark.parametrize("docs", [None, DOCS], ids=["causal", "documents"])
def test_fla_kernel_equals_chunked_form_on_gpu(docs: torch.Tensor | None) -> None:
    """flash-linear-attention's kernel against the PyTorch chunked form on CUDA (fp32 inputs,
    documents as ``cu_seqlens``): outputs and input gradients within 1e-3 relative (fla's
    Triton matmuls run in TF32). Skipped without fla."""
    from torchtitan.models.qwen3_5.delta_rule import fla_available, fla_delta_rule

    if not fla_available():
        pytest.skip("flash-linear-attention is not installed (pip install 'torchtitan[fla]')")
    inputs = [t.cuda().requires_grad_() for t in _inputs(s=21 * 7, h=4, dk=64, dv=64)]
    doc_ids = None if docs is None else docs.repeat_interleave(7, dim=1).cuda()
    ref = chunked_delta_rule(*inputs, doc_ids=doc_ids)
    ref_grads = torch.autograd.grad(ref.square().sum(), inputs)
    out = fla_delta_rule(*inputs, doc_ids=doc_ids)
    grads = torch.autograd.grad(out.float().square().sum(), inputs)
    assert _rel(out.float(), ref) < 1e-3
    for a, b in zip(grads, ref_grads, strict=True):
        assert _rel(a.float(), b) < 1e-3


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"layer_types": ["linear_attention", "sliding_attention"] * 2}, "layer_types"),
        ({"linear_conv_kernel_dim": 0}, "linear_conv_kernel_dim"),
    ],
)
def test_convert_exits_2_with_one_line(
    change: dict[str, Any], field: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``python -m torchtitan.convert from-hf`` on a Qwen3.5 folder with a bad config.json."""
    from torchtitan import convert

    config = MODELS["qwen3_5"].state_dict_adapter(DENSE).hf_config()
    config.update(change)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    code = convert.main(
        ["from-hf", str(tmp_path / "hf"), str(tmp_path / "out"), "--model", "qwen3_5"]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and field in err[0], err
