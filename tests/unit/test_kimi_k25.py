"""Kimi K2.5 (``models/kimi_k25/``, ``models/common/vision/moonvit.py``; docs/vlm.md) against
transformers' ``Kimi_K25ForConditionalGeneration`` on a tiny random config (fp32, CPU): logits
and every gradient (tower and projector included) with three images of different grids; the
export read by transformers; the config routing and the bad inputs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from torchtitan.checkpoint.storage import read_hf_folder
from torchtitan.config.errors import ConfigError
from torchtitan.models import MODELS, family_for_hf_config
from torchtitan.models.common.moe import MoE
from torchtitan.models.common.vision.moonvit import MoonViTArgs

IMAGE = 250
TEXT = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
    num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=32,
    kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_group=1,
    topk_group=1, max_position_embeddings=64,
)  # fmt: skip
VISION = dict(
    patch_size=4, pos_emb_height=4, pos_emb_width=4, pos_emb_time=4, num_attention_heads=2,
    num_hidden_layers=2, hidden_size=32, intermediate_size=48, merge_kernel_size=[2, 2],
)  # fmt: skip
GRIDS = torch.tensor([[1, 4, 6], [1, 8, 4], [1, 2, 2]])  # 6, 8 and 1 merged tokens


def _tokens() -> torch.Tensor:
    """Row 0: text, image 0, text, image 1, text; row 1: text, image 2, text (32 tokens)."""
    t = torch.randint(0, 240, (2, 32), generator=torch.Generator().manual_seed(0))
    t[0, 3:9] = IMAGE
    t[0, 13:21] = IMAGE
    t[1, 5] = IMAGE
    return t


def _pixels() -> torch.Tensor:
    n = int(GRIDS.prod(-1).sum())
    return torch.randn(n, 3 * 4 * 4, generator=torch.Generator().manual_seed(1))


def _hf_model(tie: bool = False) -> Any:
    transformers = pytest.importorskip("transformers")
    config = transformers.Kimi_K25Config(
        text_config=TEXT, vision_config=VISION, projection_hidden_size=32,
        image_token_id=IMAGE, video_token_id=251, vision_start_token_id=252,
        vision_end_token_id=253, tie_word_embeddings=tie,
    )  # fmt: skip
    torch.manual_seed(5)
    model = transformers.Kimi_K25ForConditionalGeneration(config)
    with torch.no_grad():  # non-trivial norms, biases, routing biases and position table
        gen = torch.Generator().manual_seed(6)
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model.float()


def _hf_logits(hf: Any, tokens: torch.Tensor) -> torch.Tensor:
    pixels = _pixels().view(-1, 3, 4, 4)
    return hf(input_ids=tokens, pixel_values=pixels, image_grid_thw=GRIDS).logits


def _import(folder: Path) -> tuple[Any, Any]:
    config, hf_sd = read_hf_folder(folder)
    family, args = family_for_hf_config(config)
    assert family == "kimi_k25"
    spec = MODELS[family]
    ours = spec.build(args)
    ours.load_state_dict(spec.state_dict_adapter(args).from_hf(hf_sd), strict=True)
    ours.init_buffers()  # type: ignore[operator]
    for m in ours.modules():
        if isinstance(m, MoE):  # transformers adds no auxiliary loss
            m.args = type(m.args)(**{**m.args.__dict__, "aux_loss_coef": 0.0})
    return args, ours.float()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def test_forward_backward_equal_transformers(tmp_path: Path) -> None:
    """A transformers model saved by ``save_pretrained`` and read back (config.json -> our
    args, weights through the adapter): logits and every gradient (tower and projector
    included) within 1e-5 relative. The gradients are compared in the saved layout: the
    transformers model's gradients written by its own ``save_pretrained``."""
    hf = _hf_model()
    hf.save_pretrained(tmp_path / "weights")
    args, ours = _import(tmp_path / "weights")
    assert args.vision == MoonViTArgs(
        depth=2, dim=32, n_heads=2, intermediate_size=48, out_dim=64, patch_size=4,
        pos_emb_height=4, pos_emb_width=4,
    )  # fmt: skip
    assert args.image_token_id == IMAGE and not args.tie_word_embeddings and args.mtp_depth == 0
    hf.train()
    tokens = _tokens()
    ours_logits = ours(tokens, pixel_values=_pixels(), grid_thw=GRIDS)
    hf_logits = _hf_logits(hf, tokens)
    assert _rel(ours_logits, hf_logits) <= 1e-5, _rel(ours_logits, hf_logits)
    ours_logits.square().mean().backward()
    hf_logits.square().mean().backward()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.grad)
    hf.save_pretrained(tmp_path / "grads")
    _, hf_sd = read_hf_folder(tmp_path / "grads")
    hf_grads = MODELS["kimi_k25"].state_dict_adapter(args).from_hf(hf_sd)
    worst = 0.0
    for name, p in ours.named_parameters():
        assert p.grad is not None and bool(p.grad.any()), name
        worst = max(worst, _rel(p.grad, hf_grads[name]))
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in hf.parameters()) == args.num_params()
    assert worst <= 1e-5, worst


def test_a_clip_of_frames_equals_transformers(tmp_path: Path) -> None:
    """A 3-frame clip (the time sinusoid, attention over the clip, the frame average) and a
    still image through our tower and projector: transformers' image features within 1e-5."""
    hf = _hf_model()
    hf.save_pretrained(tmp_path)
    _, ours = _import(tmp_path)
    grids = torch.tensor([[3, 4, 6], [1, 2, 2]])
    pixels = torch.randn(76, 48, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        mine = ours.image_tokens(pixels, grids)
        theirs = torch.cat(
            hf.model.get_image_features(pixels.view(-1, 3, 4, 4), grids).pooler_output
        )
    assert mine.shape == (7, 64) and _rel(mine, theirs) <= 1e-5, _rel(mine, theirs)


def test_export_round_trips_and_transformers_reads_it(tmp_path: Path) -> None:
    """Ours written as a Hugging Face folder (tied head): transformers' model has our logits;
    the state dict round-trips bit for bit; the streamed read of every tensor equals the whole
    one."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import save_file

    _hf_model(tie=True).save_pretrained(tmp_path / "a")
    args, ours = _import(tmp_path / "a")
    assert args.tie_word_embeddings
    adapter = MODELS["kimi_k25"].state_dict_adapter(args)
    sd = dict(ours.state_dict())
    exported = adapter.to_hf(sd)
    back = adapter.from_hf(exported)
    assert all(torch.equal(back[k], v) for k, v in sd.items())
    out = tmp_path / "b"
    out.mkdir()
    save_file(exported, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(adapter.hf_config()))
    again = transformers.Kimi_K25ForConditionalGeneration.from_pretrained(out, dtype=torch.float32)
    tokens = _tokens()
    with torch.no_grad():
        diff = _rel(ours(tokens, pixel_values=_pixels(), grid_thw=GRIDS), _hf_logits(again, tokens))
    assert diff <= 1e-5, diff

    # streamed boxes: from our export, and from the folder transformers wrote (its spellings)
    _, saved = read_hf_folder(tmp_path / "a")
    assert any(".blocks." in k for k in saved if k.startswith("language_model."))
    for tensors in (exported, saved):
        source = _Source(tensors)
        for key, full in sd.items():
            box = tuple(slice(1 if n > 1 else 0, n) for n in full.shape)
            got = adapter.from_hf_box(key, tuple(full.shape), box, source)
            assert torch.equal(got, full[box]), key


class _Source:
    """An in-memory ``HFSource`` (``models/common/hf/mapping.py``)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def read(self, name: str, box: Any) -> torch.Tensor:
        return self.tensors[name][box]


REMOTE_CONFIG = {
    "architectures": ["KimiK25ForConditionalGeneration"],
    "model_type": "kimi_k25",
    "media_placeholder_token_id": IMAGE,
    "tie_word_embeddings": False,
    "use_unified_vision_chunk": True,
    "video_placeholder": "<|kimi_k25_video_placeholder|>",
    "video_token_id": 251,
    "vision_start_token_id": 252,
    "vision_end_token_id": 253,
    "text_config": {
        **TEXT, "model_type": "kimi_k2", "num_nextn_predict_layers": 0,
        "routed_scaling_factor": 2.5,
    },
    "vision_config": {
        "vt_hidden_size": 32, "vt_num_hidden_layers": 2, "vt_num_attention_heads": 2,
        "vt_intermediate_size": 48, "mm_hidden_size": 32, "text_hidden_size": 64,
        "patch_size": 4, "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool",
        "mm_projector_type": "patchmerger", "projector_hidden_act": "gelu",
        "projector_ln_eps": 1e-5, "video_attn_type": "spatial_temporal",
        "pos_emb_type": "divided_fixed", "init_pos_emb_height": 4, "init_pos_emb_width": 4,
        "init_pos_emb_time": 4,
    },
}  # fmt: skip
"""The published checkpoints' remote-code layout of ``config.json`` (tiny sizes)."""


def test_remote_code_config_routes_to_the_same_args(tmp_path: Path) -> None:
    """The published (remote-code) ``config.json`` and transformers' own give equal args."""
    _hf_model().save_pretrained(tmp_path)
    config, _ = read_hf_folder(tmp_path)
    family, theirs = family_for_hf_config(REMOTE_CONFIG)
    assert family == "kimi_k25"
    assert theirs == family_for_hf_config(config)[1]
    assert MODELS["kimi_k25"].hf.config.check_keys(REMOTE_CONFIG) == []  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("vision", "field"),
    [
        ({"merge_type": "sd2"}, "vision_config.merge_type"),
        ({"mm_hidden_size": 16}, "vision_config.mm_hidden_size"),
        ({"vt_hidden_size": 30}, "vision_config.hidden_size"),
        ({"init_pos_emb_width": 8}, "vision_config.pos_emb_width"),
        ({"deepstack": [1]}, "vision_config.deepstack"),
    ],
)
def test_bad_vision_config_is_one_line(vision: dict[str, Any], field: str) -> None:
    config = {**REMOTE_CONFIG, "vision_config": {**REMOTE_CONFIG["vision_config"], **vision}}
    with pytest.raises(ConfigError) as err:
        family_for_hf_config(config)
    assert field in str(err.value) and "\n" not in str(err.value)


def test_multi_token_prediction_and_a_foreign_placeholder_are_refused() -> None:
    from tests.tiny_args import tiny_kimi_k25

    with pytest.raises(ConfigError, match="model.mtp_depth"):
        tiny_kimi_k25(mtp_depth=1)
    with pytest.raises(ConfigError, match="image_token_id"):
        tiny_kimi_k25(vocab_size=128)


def test_a_batch_without_images_runs_the_tower_on_nothing() -> None:
    """Empty ``pixel_values`` / ``grid_thw`` (a rank whose samples have no image): the tower
    and projector run on zero patches (every FSDP rank runs its units), the logits equal the
    text-only forward, and backward reaches the tower with zero gradients."""
    from tests.tiny_args import tiny_kimi_k25

    model = MODELS["kimi_k25"].build(tiny_kimi_k25())
    model.init_weights(seed=0)  # type: ignore[operator]
    tokens = torch.randint(0, 240, (2, 16), generator=torch.Generator().manual_seed(0))
    empty = torch.zeros(0, 3 * 4 * 4)
    logits = model(tokens, pixel_values=empty, grid_thw=torch.zeros(0, 3, dtype=torch.long))
    assert torch.equal(logits, model(tokens))
    logits.square().mean().backward()
    for name in (
        "vision_tower.patch_embed.pos_emb.weight",
        "vision_tower.encoder.blocks.0.wqkv.weight",
        "mm_projector.proj.0.weight",
    ):
        grad = model.get_parameter(name).grad
        assert grad is not None and not bool(grad.any()), name


def test_placeholders_and_images_must_agree() -> None:
    from tests.tiny_args import tiny_kimi_k25

    model = MODELS["kimi_k25"].build(tiny_kimi_k25())
    model.init_weights(seed=0)  # type: ignore[operator]
    tokens = torch.full((1, 8), 7)
    tokens[0, 2:4] = IMAGE
    with pytest.raises(ValueError, match="no pixel_values"):
        model(tokens)
    one = torch.zeros(4, 3 * 4 * 4)  # a 2 x 2 grid: one merged token for two placeholders
    with pytest.raises(ValueError, match="2 image placeholder tokens but 1") as err:
        model(tokens, pixel_values=one, grid_thw=torch.tensor([[1, 2, 2]]))
    assert "\n" not in str(err.value)


def test_plan_places_the_tower_for_every_layout() -> None:
    """Its own FSDP units, AC/compile per block, the first pipeline unit, whole inputs under
    CP, replicated under TP; no layout refused (tests/integration/test_kimi_parallel.py)."""
    args = MODELS["kimi_k25"].flavors["debugmodel"]
    plan = MODELS["kimi_k25"].parallel_plan(args)
    assert plan.fsdp_units == (
        "vision_tower.encoder.blocks.0",
        "vision_tower.encoder.blocks.1",
        "vision_tower",
        "mm_projector",
    )
    assert plan.extra_blocks == ("vision_tower.encoder.blocks",)
    assert plan.pipeline_units[0].modules == (
        "tok_embeddings",
        "vision_tower",
        "mm_projector",
        "scatter",
    )
    assert plan.context_parallel is not None
    assert plan.context_parallel.whole_inputs == ("pixel_values", "grid_thw")
    assert {"vision_tower", "mm_projector", "scatter"} <= set(plan.tensor_parallel.root)
    assert not plan.refusals
    model = MODELS["kimi_k25"].build(args)
    assert all(model.get_submodule(path) is not None for path in plan.fsdp_units)


def test_published_flavor_counts() -> None:
    """The 1T flavor: 1.03T parameters, 33.3B active per token (32.9B in the decoder, the
    0.47B MoonViT and projector)."""
    args = MODELS["kimi_k25"].flavors["1T"]
    assert round(args.num_params() / 1e9) == 1027
    assert round(args.num_params(active=True) / 1e9, 1) == 33.3
    assert round(args.vision.num_params() / 1e9, 2) == 0.47


def test_preflight_reads_a_folder_transformers_wrote(tmp_path: Path) -> None:
    """The weight-folder check (``checkpoint.initial_load_in_hf``) finds every tensor of a
    ``save_pretrained`` folder under its transformers spelling, and the streamed import reads
    them equal to the whole-file import; a missing tensor still fails the check."""
    from torchtitan.preflight.validate_weights import check_hf_model

    _hf_model().save_pretrained(tmp_path)
    config, _ = read_hf_folder(tmp_path)
    _, args = family_for_hf_config(config)
    field = "checkpoint.initial_load_path"
    check_hf_model(tmp_path, field, "kimi_k25", args, "kimi_k25", fit=True)
    from torchtitan.checkpoint.hf_io import load_hf_streaming

    model = MODELS["kimi_k25"].build(args)
    adapter = MODELS["kimi_k25"].state_dict_adapter(args)
    load_hf_streaming([model], adapter, tmp_path)  # the trainer's streamed import
    whole = adapter.from_hf(read_hf_folder(tmp_path)[1])
    assert all(torch.equal(v, whole[k]) for k, v in model.state_dict().items() if k in whole)
    assert set(whole) <= set(model.state_dict())
    bigger = type(args)(**{**args.__dict__, "n_layers": 3})
    with pytest.raises(ConfigError, match="language_model.model.layers.2") as err:
        check_hf_model(tmp_path, field, "kimi_k25", bigger, "kimi_k25", fit=True)
    assert "\n" not in str(err.value)


def test_tower_flops_equal_torch_flop_counter() -> None:
    """The shared per-patch count (``models/common/vision/flops.py``, behind MFU and the
    planner) holds for MoonViT + projector: forward + backward of two images (8 x 8 and 4 x 4
    patches; pixels without gradient) equals torch's FLOP counter exactly."""
    from torch.utils.flop_counter import FlopCounterMode

    from tests.tiny_args import tiny_kimi_k25
    from torchtitan.models.common.vision.flops import tower_training_flops
    from torchtitan.models.common.vision.moonvit import MoonViT, Projector

    v = tiny_kimi_k25().vision
    tower, projector = MoonViT(v), Projector(v)
    for p in [*tower.parameters(), *projector.parameters()]:
        torch.nn.init.normal_(p, std=0.02)
    grids = torch.tensor([[1, 8, 8], [1, 4, 4]])
    pixels = torch.randn(80, v.patch_dim)
    with FlopCounterMode(display=False) as counter:
        projector(tower(pixels, grids)).sum().backward()
    ours = sum(tower_training_flops(v, int(g.prod())) for g in grids)  # type: ignore[arg-type]
    assert counter.get_total_flops() == ours
