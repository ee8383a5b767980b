"""Qwen3.5 with vision (``models/qwen3_5_vl/``, ``models/common/vision/``; docs/vlm.md)
against transformers' ``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5MoeForConditionalGeneration``
on tiny random configs (fp32): logits and every gradient, an image batch of three images of
different grids; the MRoPE positions, the export, the bad inputs."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.tiny_args import tiny_qwen3_5
from torchtitan.checkpoint.storage import read_hf_folder
from torchtitan.config.errors import ConfigError
from torchtitan.models import MODELS
from torchtitan.models.common.moe import MoE, MoEArgs
from torchtitan.models.common.vision import VisionArgs, mrope_positions
from torchtitan.models.qwen3_5_vl import QWEN35_VL_FLAVORS, Qwen35VLArgs

IMAGE = 250
VISION = dict(
    depth=2, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=64,
    in_channels=3, patch_size=4, temporal_patch_size=2, spatial_merge_size=2,
    num_position_embeddings=16,
)  # fmt: skip
GRIDS = torch.tensor([[1, 4, 6], [1, 8, 4], [1, 2, 2]])  # 6, 8 and 1 merged tokens
MOE_TEXT = dict(
    n_layers=2,
    tie_word_embeddings=False,
    moe=MoEArgs(num_experts=8, top_k=2, expert_dim=32),
    shared_expert_dim=48,
)


def _tokens() -> torch.Tensor:
    """Row 0: text, image 0, text, image 1, text; row 1: text, image 2, text (32 tokens)."""
    t = torch.randint(0, 240, (2, 32), generator=torch.Generator().manual_seed(0))
    t[0, 3:9] = IMAGE
    t[0, 13:21] = IMAGE
    t[1, 5] = IMAGE
    return t


def _pixels() -> torch.Tensor:
    n = int(GRIDS.prod(-1).sum())
    return torch.randn(n, 3 * 2 * 4 * 4, generator=torch.Generator().manual_seed(1))


def _hf_model(text: Any) -> Any:
    transformers = pytest.importorskip("transformers")
    common = dict(
        vocab_size=text.vocab_size,
        hidden_size=text.dim,
        num_hidden_layers=text.n_layers,
        num_attention_heads=text.n_heads,
        num_key_value_heads=text.n_kv_heads,
        head_dim=text.head_dim,
        layer_types=list(text.layer_types),
        linear_num_key_heads=text.linear_num_key_heads,
        linear_num_value_heads=text.linear_num_value_heads,
        linear_key_head_dim=text.linear_key_head_dim,
        linear_value_head_dim=text.linear_value_head_dim,
        max_position_embeddings=text.max_seq_len,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": text.rope_theta,
            "partial_rotary_factor": text.partial_rotary_factor,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
    )
    tokens = dict(image_token_id=IMAGE, video_token_id=251, vision_start_token_id=252)
    torch.manual_seed(5)
    if text.moe is None:
        config = transformers.Qwen3_5Config(
            text_config={**common, "intermediate_size": text.intermediate_size},
            vision_config=VISION,
            tie_word_embeddings=text.tie_word_embeddings,
            vision_end_token_id=253,
            **tokens,
        )
        model = transformers.Qwen3_5ForConditionalGeneration(config)
    else:
        moe = dict(
            num_experts=text.moe.num_experts,
            num_experts_per_tok=text.moe.top_k,
            moe_intermediate_size=text.moe.expert_dim,
            shared_expert_intermediate_size=text.shared_expert_dim,
        )
        config = transformers.Qwen3_5MoeConfig(
            text_config={**common, **moe},
            vision_config=VISION,
            tie_word_embeddings=text.tie_word_embeddings,
            vision_end_token_id=253,
            **tokens,
        )
        model = transformers.Qwen3_5MoeForConditionalGeneration(config)
    with torch.no_grad():  # non-trivial norms, biases, decays and gates
        gen = torch.Generator().manual_seed(6)
        for name, p in model.named_parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.05, 1.0, generator=gen).log())
    return model.float()


def _import(hf: Any, folder: Path) -> tuple[Qwen35VLArgs, Any]:
    hf.save_pretrained(folder)
    config, hf_sd = read_hf_folder(folder)
    spec = MODELS["qwen3_5_vl"]
    args = spec.hf.config.args_from_hf(config)  # type: ignore[attr-defined]
    ours = spec.build(args)
    ours.load_state_dict(spec.state_dict_adapter(args).from_hf(hf_sd), strict=True)
    ours.init_buffers()  # type: ignore[operator]
    return args, ours.float()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _hf_logits(hf: Any, tokens: torch.Tensor) -> torch.Tensor:
    kinds = (tokens == IMAGE).int()
    return hf(
        input_ids=tokens, pixel_values=_pixels(), image_grid_thw=GRIDS, mm_token_type_ids=kinds
    ).logits


@pytest.mark.parametrize("text", [{}, MOE_TEXT], ids=["dense", "moe"])
def test_forward_backward_equal_transformers(text: dict[str, Any], tmp_path: Path) -> None:
    """A transformers model saved and read back (config.json -> our args, weights through the
    adapter): logits and every gradient (vision tower included) within 1e-5 relative."""
    hf = _hf_model(tiny_qwen3_5(**text))
    args, ours = _import(hf, tmp_path)
    assert args.vision == VisionArgs(**{"dim": 32, "n_heads": 2, "out_dim": 64, **_own(VISION)})
    assert args.mrope_section == (2, 1, 1) and args.image_token_id == IMAGE
    for m in ours.modules():
        if isinstance(m, MoE):  # transformers adds its auxiliary loss only with labels
            m.args = dataclasses.replace(m.args, aux_loss_coef=0.0)
    hf.train()
    tokens = _tokens()
    ours_logits = ours(tokens, pixel_values=_pixels(), grid_thw=GRIDS)
    hf_logits = _hf_logits(hf, tokens)
    assert _rel(ours_logits, hf_logits) <= 1e-5
    ours_logits.square().mean().backward()
    hf_logits.square().mean().backward()
    adapter = MODELS["qwen3_5_vl"].state_dict_adapter(args)
    hf_grads = adapter.from_hf({n: p.grad for n, p in hf.named_parameters()})
    worst = 0.0
    for name, p in ours.named_parameters():  # a tied head is listed once, as the embedding
        assert p.grad is not None and bool(p.grad.any()), name
        worst = max(worst, _rel(p.grad, hf_grads[name]))
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in hf.parameters()) == args.num_params()
    assert worst <= 1e-5, worst


def _own(vision: dict[str, Any]) -> dict[str, Any]:
    drop = ("hidden_size", "num_heads", "out_hidden_size")
    return {k: v for k, v in vision.items() if k not in drop}


def test_export_round_trips_and_transformers_reads_it(tmp_path: Path) -> None:
    """Ours written as a Hugging Face folder: transformers' model has our logits; the state
    dict round-trips bit for bit; the streamed read of every tensor equals the whole one."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import save_file

    hf = _hf_model(tiny_qwen3_5())
    args, ours = _import(hf, tmp_path / "a")
    adapter = MODELS["qwen3_5_vl"].state_dict_adapter(args)
    sd = dict(ours.state_dict())
    exported = adapter.to_hf(sd)
    back = adapter.from_hf(exported)
    assert all(torch.equal(back[k], v) for k, v in sd.items())
    out = tmp_path / "b"
    out.mkdir()
    save_file(exported, str(out / "model.safetensors"))
    import json

    (out / "config.json").write_text(json.dumps(adapter.hf_config()))
    again = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(out, dtype=torch.float32)
    tokens = _tokens()
    with torch.no_grad():
        diff = _rel(ours(tokens, pixel_values=_pixels(), grid_thw=GRIDS), _hf_logits(again, tokens))
    assert diff <= 1e-5, diff

    class Source:
        def __contains__(self, name: object) -> bool:
            return name in exported

        def shape(self, name: str) -> tuple[int, ...]:
            return tuple(exported[name].shape)

        def read(self, name: str, box: Any) -> torch.Tensor:
            return exported[name][box]

    for key, full in sd.items():
        box = tuple(slice(1 if n > 1 else 0, n) for n in full.shape)
        assert torch.equal(adapter.from_hf_box(key, tuple(full.shape), box, Source()), full[box])


def test_mrope_positions() -> None:
    """Text counts up in all three rows; an image's tokens take (start + t, start + row,
    start + column) of its merged grid; the text after it resumes at start + max(h, w)."""
    tokens = torch.tensor([[7, 7, IMAGE, IMAGE, IMAGE, IMAGE, IMAGE, IMAGE, 7]])
    pos = mrope_positions(tokens, IMAGE, torch.tensor([[1, 4, 6]]), 2)  # 2 x 3 merged
    assert pos[:, 0, :2].tolist() == [[0, 1]] * 3
    assert pos[0, 0, 2:8].tolist() == [2] * 6
    assert pos[1, 0, 2:8].tolist() == [2, 2, 2, 3, 3, 3]
    assert pos[2, 0, 2:8].tolist() == [2, 3, 4, 2, 3, 4]
    assert pos[:, 0, 8].tolist() == [5, 5, 5]


def test_more_placeholders_than_images_is_one_line() -> None:
    args = MODELS["qwen3_5_vl"].flavors["debugmodel"]
    tokens = torch.tensor([[1, 2, args.image_token_id, 3]])
    with pytest.raises(ValueError, match="more placeholders than images") as err:
        mrope_positions(tokens, args.image_token_id, torch.zeros(0, 3, dtype=torch.long), 2)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"dim": 30}, "vision_config.hidden_size"),
        ({"num_position_embeddings": 15}, "vision_config.num_position_embeddings"),
        ({"hidden_act": "relu"}, "vision_config.hidden_act"),
    ],
)
def test_bad_vision_config_is_one_line(change: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        VisionArgs(**change)
    assert field in str(err.value) and "\n" not in str(err.value)


def test_image_size_must_be_whole_merged_patches() -> None:
    v = MODELS["qwen3_5_vl"].flavors["debugmodel"].vision
    assert v.image_size_problem(64, 96) is None
    problem = v.image_size_problem(64, 100)
    assert problem is not None and "32" in str(problem)


def test_a_batch_without_images_runs_the_tower_on_nothing() -> None:
    """A rank whose samples have no image passes empty ``pixel_values`` / ``grid_thw`` (the
    collated form): the tower runs on zero patches (every FSDP rank runs its units), the
    logits equal the text-only forward, and backward reaches the tower with zero gradients."""
    from tests.tiny_args import tiny_qwen3_5_vl

    model = MODELS["qwen3_5_vl"].build(tiny_qwen3_5_vl())
    model.init_weights(seed=0)
    tokens = torch.randint(0, 240, (2, 16), generator=torch.Generator().manual_seed(0))
    empty = torch.zeros(0, 3 * 2 * 4 * 4)
    logits = model(tokens, pixel_values=empty, grid_thw=torch.zeros(0, 3, dtype=torch.long))
    assert torch.equal(logits, model(tokens))
    logits.square().mean().backward()
    grad = model.visual.blocks[0].attn.qkv.weight.grad
    assert grad is not None and not bool(grad.any())


def test_plan_gives_the_tower_its_own_units_and_places_it_for_every_layout() -> None:
    """The tower: its own FSDP units and AC/compile blocks; replicated on the TP ranks with the
    scatter's output placed (tests/integration/test_vlm_parallel.py); on the first pipeline
    stage with the embedding and the scatter; its images whole on every cp rank; nothing
    refused (docs/vlm.md, "Parallelism")."""
    args = MODELS["qwen3_5_vl"].flavors["debugmodel"]
    plan = MODELS["qwen3_5_vl"].parallel_plan(args)
    assert plan.fsdp_units == ("visual.blocks.0", "visual.blocks.1", "visual")
    assert plan.extra_blocks == ("visual.blocks",)
    assert not plan.refusals
    assert plan.pipeline_units[0].modules == ("tok_embeddings", "visual", "scatter")
    assert plan.context_parallel is not None
    assert plan.context_parallel.whole_inputs == ("pixel_values", "grid_thw")
    model = MODELS["qwen3_5_vl"].build(args)
    paths = [*plan.fsdp_units, *plan.extra_blocks, "scatter", *plan.tensor_parallel.root]
    assert all(model.get_submodule(path) is not None for path in paths)


def test_published_flavor_counts_equal_transformers() -> None:
    """``397B-A17B``: the text decoder's published count plus a tower whose parameters equal
    transformers' ``Qwen3_5VisionModel`` built from its default vision config (the published
    tower) projecting to width 4096, counted on the meta device."""
    import transformers

    from torchtitan.models.qwen3_5 import QWEN35_FLAVORS

    args = QWEN35_VL_FLAVORS["397B-A17B"]
    config = transformers.Qwen3_5VisionConfig(out_hidden_size=4096)
    with torch.device("meta"):
        tower = transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5VisionModel(config)
    theirs = sum(p.numel() for p in tower.parameters())
    assert args.vision.num_params() == theirs
    assert args.num_params() == QWEN35_FLAVORS["397B-A17B"].num_params() + theirs
