"""Image-text samples mixed with text at weights (``data/vlm_mixture.py``; docs/vlm.md, "Data"):
the shares over many rows, text rows without images, resume at the next batch, rows that do not
depend on the data-parallel degree, text mixtures unchanged bit for bit, and the run's image
token ids reaching the data."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.tokenized_helpers import CORPUS, TOKENIZER, split_jsonl
from torchtitan.config.job_config import MixtureSource, Training
from torchtitan.config.sections import Sft
from torchtitan.data.builder import DataOptions, build_data_loader
from torchtitan.data.rank_loader import rank_dataloader
from torchtitan.data.tokenizer import build_tokenizer
from torchtitan.loss.chunked import IGNORE_INDEX
from torchtitan.models.qwen3_5_vl import QWEN35_VL_FLAVORS

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import make_vlm_data  # noqa: E402

SEQ = 256
ARGS = QWEN35_VL_FLAVORS["debugmodel"]  # tower: 16-pixel patches, 2 x 2 merge, 2 frames


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """An image-text parquet of 7 samples (every 3rd without an image, one of them corrupt
    and one oversized are added by ``--bad``) and a text JSONL."""
    root = tmp_path_factory.mktemp("vlm_mix")
    make_vlm_data.write(root / "img", 7, seed=4, bad=False, oversized=400, text_only_every=3)
    text = split_jsonl(CORPUS / "validation.jsonl", root / "text", parts=1, lines=200)
    return {"images": root / "img" / "vlm.parquet", "text": text / "part-0.jsonl"}


class _Mesh:
    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world

    def get_local_rank(self) -> int:
        return self.rank

    def size(self) -> int:
        return self.world


def _loader(data: dict[str, Path], rank: int = 0, dp: int = 1, batch: int = 2, **kw: Any):  # noqa: ANN202
    weights = kw.pop("weights", (3.0, 7.0))
    images = kw.pop("images", data["images"])
    mixture = [
        MixtureSource(path=str(images), dataset="vlm", weight=weights[0]),
        MixtureSource(path=str(data["text"]), weight=weights[1]),
    ]
    t = Training(dataset="mixture", mixture=mixture, seq_len=SEQ, local_batch_size=batch)
    return rank_dataloader(
        t, Sft(), build_tokenizer(TOKENIZER), _Mesh(rank, dp), dataset="mixture",  # type: ignore[arg-type]
        dataset_path=None, split="train", infinite=True, seed=0, with_doc_ids=False,
        model_args=kw.pop("args", ARGS),
    )  # fmt: skip


def _is_text_row(inputs: torch.Tensor, labels: torch.Tensor) -> bool:
    """A packed text window: every label a target and equal to the next input."""
    return bool((labels != IGNORE_INDEX).all()) and torch.equal(inputs[1:], labels[:-1])


def test_shares_rows_and_masks_follow_the_weights(data: dict[str, Path]) -> None:
    """120 rows at weights 3 : 7: exactly 36 image-text rows and 84 text rows (the mixture's
    order gives every source its share to within one row); text rows have no patches and no
    placeholder, image-text rows are padded and masked as the ``vlm`` dataset's, and the batch's
    patches are the image rows' patches in order."""
    it = iter(_loader(data, batch=4))
    text_rows = image_rows = 0
    for _ in range(30):
        b = next(it)
        assert b["inputs"].shape == b["labels"].shape == (4, SEQ)
        images = int((b["inputs"] == ARGS.image_token_id).sum())
        merged = int(b["grid_thw"].prod(-1).sum()) // 4 if len(b["grid_thw"]) else 0
        assert images == merged and b["pixel_values"].shape == (merged * 4, 3 * 2 * 16 * 16)
        for inputs, labels in zip(b["inputs"], b["labels"], strict=True):
            if _is_text_row(inputs, labels):
                text_rows += 1
                assert not bool((inputs == ARGS.image_token_id).any())
            else:
                image_rows += 1
                assert not bool((labels == ARGS.image_token_id).any())
                assert labels[-1] == IGNORE_INDEX  # short samples are padded
    assert (image_rows, text_rows) == (36, 84)


def test_resume_gives_the_next_batch_and_rows_do_not_depend_on_dp(data: dict[str, Path]) -> None:
    """The loader's state after 3 batches, loaded into a new loader: its next 2 batches are
    batches 4 and 5 of an uninterrupted run; two data-parallel ranks' rows interleaved are the
    one-rank rows (each rank decodes only its own image samples)."""
    straight = iter(_loader(data))
    want = [next(straight) for _ in range(5)]
    first = _loader(data)
    it = iter(first)
    for _ in range(3):
        next(it)
    resumed = _loader(data)
    resumed.load_state_dict(first.state_dict())
    again = iter(resumed)
    for w in want[3:]:
        got = next(again)
        assert all(torch.equal(got[k], w[k]) for k in w)
    ranks = [iter(_loader(data, rank=r, dp=2, batch=1)) for r in (0, 1)]
    rows = torch.cat([w["inputs"] for w in want[:2]])
    split = torch.cat([next(ranks[r])["inputs"] for _ in range(2) for r in (0, 1)])
    assert torch.equal(split, rows)


def test_a_skipped_sample_gives_way_to_the_next(tmp_path: Path, data: dict[str, Path]) -> None:
    """A corrupt image's sample is skipped and counted; its window takes the next usable
    sample (the source keeps its place, so the shares stay exact)."""
    make_vlm_data.write(tmp_path, 2, seed=6, bad=True, oversized=400)
    bad = tmp_path / "bad.parquet"
    import pyarrow.parquet as pq

    table = pq.read_table(tmp_path / "vlm.parquet")
    pq.write_table(table.slice(0, 4), bad)  # rows 0, 1 good, 2 corrupt, 3 good
    loader = _loader(data, images=bad, weights=(1.0, 1.0), batch=8)
    b = next(iter(loader))
    text = [_is_text_row(i, lab) for i, lab in zip(b["inputs"], b["labels"], strict=True)]
    assert text == [False, True] * 4
    image_rows = b["inputs"][0::2]
    assert torch.equal(image_rows[2], image_rows[3])  # window 2 took row 3
    assert not any(torch.equal(image_rows[i], image_rows[j]) for i, j in [(0, 1), (0, 3), (1, 3)])
    assert loader.dataset.skipped() == {"bad.parquet: bad image": 1}


def test_text_mixtures_unchanged_bit_for_bit() -> None:
    """Two text sources at 3 : 1, rank 1 of 2, with document ids: the first 20 batches hash to
    the value main gave before image-text sources were added to the mixture."""
    import tempfile

    root = Path(tempfile.mkdtemp())
    val = CORPUS / "validation.jsonl"
    a = split_jsonl(val, root / "a", parts=1, lines=150) / "part-0.jsonl"
    lines = val.read_text().splitlines()[150:300]
    (root / "b").mkdir()
    (root / "b" / "b.jsonl").write_text("".join(line + "\n" for line in lines))
    srcs = [
        MixtureSource(path=str(a), weight=3.0),
        MixtureSource(path=str(root / "b" / "b.jsonl"), weight=1.0),
    ]
    tok = build_tokenizer(TOKENIZER)
    loader = build_data_loader(
        "mixture", None, tok, 32, 2, 1, 2, with_doc_ids=True, options=DataOptions(mixture=srcs)
    )
    h, it = hashlib.sha256(), iter(loader)
    for _ in range(20):
        for t in next(it):
            h.update(t.numpy().tobytes())
    assert h.hexdigest() == "23ef59df16fb40658d3ab11a6251ec6260835074f44e5556596e539c95d79add"


def test_the_runs_image_token_ids_reach_the_data(data: dict[str, Path]) -> None:
    """Args with other token ids (as a ``config.json`` gives them: a placeholder and vision
    start/end ids inside the vocabulary, reserved ids of the test tokenizer) make the data's
    placeholders, each image wrapped by start/end; the debug flavor's start/end ids, outside
    its vocabulary, wrap nothing."""
    args = dataclasses.replace(
        ARGS, image_token_id=2045, vision_start_token_id=2043, vision_end_token_id=2044
    )
    mine = next(iter(_loader(data, args=args, weights=(1.0, 1e-9), batch=3)))
    flavor = next(iter(_loader(data, weights=(1.0, 1e-9), batch=3)))
    images = 0
    for ours, theirs in zip(mine["inputs"], flavor["inputs"], strict=True):
        n = int((theirs == ARGS.image_token_id).sum())
        assert int((ours == 2045).sum()) == n and not bool((ours == ARGS.image_token_id).any())
        runs = int(((theirs[1:] == 2047) & (theirs[:-1] != 2047)).sum())  # images in the row
        assert int((ours == 2043).sum()) == int((ours == 2044).sum()) == runs
        images += runs
        kept = ours[(ours != 2043) & (ours != 2044)]  # without start/end: the flavor's row
        assert torch.equal(torch.where(kept == 2045, 2047, kept), theirs[: len(kept)])
    assert images == 3 and not bool((flavor["inputs"] == 2043).any())
    assert torch.equal(mine["pixel_values"], flavor["pixel_values"])


def test_text_rows_have_plain_positions(data: dict[str, Path]) -> None:
    """In a batch of image-text and text rows (1 : 1), the MRoPE positions of each text row
    are its plain positions in all three rows, and an image row's are not."""
    from torchtitan.models.common.vision.positions import mrope_positions

    b = next(iter(_loader(data, weights=(1.0, 1.0), batch=4)))
    pos = mrope_positions(b["inputs"], ARGS.image_token_id, b["grid_thw"], 2)
    plain = torch.arange(SEQ).expand(3, SEQ)
    kinds = [_is_text_row(i, lab) for i, lab in zip(b["inputs"], b["labels"], strict=True)]
    assert kinds == [False, True, False, True]
    assert all(torch.equal(pos[:, r], plain) for r in (1, 3))
    assert not torch.equal(pos[:, 0], plain)  # row 0 holds an image


def test_image_text_source_refused_without_samples(tmp_path: Path, data: dict[str, Path]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    empty = tmp_path / "empty.parquet"
    columns = {"text": pa.array([], pa.string()), "images": pa.array([], pa.list_(pa.binary()))}
    pq.write_table(pa.table(columns), empty)
    with pytest.raises(ValueError, match="holds no sample"):
        _loader(data, images=empty)


def _mixture_toml(tmp_path: Path, images: str, text: Path, model: str = "qwen3_5_vl") -> list[str]:
    from tests.parity import DEBUG_TOML

    path = tmp_path / "mix.toml"
    path.write_text(
        f'extends = "{DEBUG_TOML}"\n[model]\nname = "{model}"\n[training]\n'
        f'dataset = "mixture"\nseq_len = {SEQ}\nlocal_batch_size = 2\nsteps = 3\n'
        'mixed_precision_param = "float32"\n'
        f'[[training.mixture]]\ndataset = "vlm"\npath = "{images}"\nweight = 1.0\n'
        f'[[training.mixture]]\npath = "{text}"\nweight = 1.0\n'
        "[lr_scheduler]\nwarmup_steps = 1\n[metrics]\nlog_freq = 1\nenable_tensorboard = false\n"
        "[checkpoint]\nenable = false\n[validation]\nenable = false\n"
    )
    return ["--job.config_file", str(path), "--job.dump_folder", str(tmp_path / "out")]


@pytest.mark.parametrize(
    ("model", "images", "field", "needle"),
    [
        ("qwen3_5", "{images}", "training.dataset", "needs a model with a vision tower"),
        ("qwen3_5_vl", "/nonexistent.parquet", "training.mixture[0].path", "must be a .parquet"),
    ],
    ids=["text-model", "missing-path"],
)
def test_bad_image_text_mixture_is_one_config_error(
    tmp_path: Path, data: dict[str, Path], model: str, images: str, field: str, needle: str
) -> None:
    from torchtitan.config import ConfigError
    from torchtitan.preflight.validate import load_config

    argv = _mixture_toml(tmp_path, images.format(images=data["images"]), data["text"], model)
    with pytest.raises(ConfigError) as e:
        load_config(argv, world_size=1)
    assert e.value.field == field and needle in str(e.value), str(e.value)


def test_trainer_trains_on_an_image_text_mixture(tmp_path: Path, data: dict[str, Path]) -> None:
    """Three steps of ``qwen3_5_vl debugmodel`` through the trainer on image-text and text
    rows at 1 : 1, the image-text rows chat samples (a folder whose first file is a chat
    parquet, then a captions one): it runs, logs each source's tokens, and the loss falls."""
    import random
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.parity import read_jsonl
    from torchtitan.train import main

    folder = tmp_path / "images"
    folder.mkdir()
    rng = random.Random(0)
    pngs = [make_vlm_data.png(rng) for _ in range(4)]
    chats = [
        [
            {"role": "user", "content": [{"type": "image", "text": None},
                                         {"type": "text", "text": "Which colour?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": f"It is {colour}."}]},
        ]
        for _, colour in pngs
    ]  # fmt: skip
    table = pa.table({"messages": chats, "images": [[png] for png, _ in pngs]})
    pq.write_table(table, folder / "a_chat.parquet")
    shutil.copy(data["images"], folder / "b_captions.parquet")
    assert main(_mixture_toml(tmp_path, str(folder), data["text"])) == 0
    rows = read_jsonl(tmp_path / "out" / "metrics" / "rank_0.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["loss"] < rows[0]["loss"], [r["loss"] for r in rows]
    assert rows[-1]["data/tokens_images"] == rows[-1]["data/tokens_part-0.jsonl"] == 3 * SEQ


def test_ids_of_an_imported_config_json_reach_data_and_model(data: dict[str, Path]) -> None:
    """Args read from a transformers ``Qwen3_5Config`` (placeholder 2045, vision start 2043,
    end 2044, a 16-pixel-patch tower): the loader built from them wraps each image's
    placeholders in start/end, and the model built from the same args consumes the batch
    (one placeholder per merged tower token) with finite logits."""
    transformers = pytest.importorskip("transformers")
    from tests.tiny_args import tiny_qwen3_5
    from torchtitan.models import MODELS

    text = tiny_qwen3_5(vocab_size=2048, max_seq_len=SEQ)
    vision = dict(
        depth=1, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=text.dim,
        patch_size=16, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16,
    )  # fmt: skip
    text_config = dict(
        vocab_size=2048, hidden_size=text.dim, num_hidden_layers=text.n_layers,
        num_attention_heads=text.n_heads, num_key_value_heads=text.n_kv_heads,
        head_dim=text.head_dim, layer_types=list(text.layer_types),
        intermediate_size=text.intermediate_size, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 1, 1],
                         "partial_rotary_factor": 0.5, "mrope_interleaved": True},
    )  # fmt: skip
    config = transformers.Qwen3_5Config(
        text_config=text_config, vision_config=vision, image_token_id=2045,
        vision_start_token_id=2043, vision_end_token_id=2044, tie_word_embeddings=True,
    )  # fmt: skip
    spec = MODELS["qwen3_5_vl"]
    as_json = json.loads(config.to_json_string())  # what save_pretrained writes
    args = spec.hf.config.args_from_hf(as_json)  # type: ignore[attr-defined]
    assert (args.image_token_id, args.vision_start_token_id) == (2045, 2043)
    b = next(iter(_loader(data, args=args, weights=(1.0, 1e-9), batch=2)))
    n = int((b["inputs"] == 2045).sum())
    assert n == int(b["grid_thw"].prod(-1).sum()) // 4 > 0
    assert (
        int((b["inputs"] == 2043).sum()) == int((b["inputs"] == 2044).sum()) == len(b["grid_thw"])
    )
    model = spec.build(args)
    model.init_weights(seed=0)  # type: ignore[operator]
    logits = model(b["inputs"], pixel_values=b["pixel_values"], grid_thw=b["grid_thw"])
    assert logits.shape == (2, SEQ, 2048) and bool(logits.isfinite().all())


def test_random_access_reads_the_samples_in_order(tmp_path: Path) -> None:
    """``RawIndex`` over a tar shard and a parquet file (two row groups): sample ``i`` is the
    ``i``-th of reading the files in order (names, texts, image bytes)."""
    import pyarrow.parquet as pq

    from torchtitan.data.vlm_dataset import read_source
    from torchtitan.data.vlm_mixture import RawIndex

    make_vlm_data.write(tmp_path, 5, seed=8, bad=False, oversized=400)
    table = pq.read_table(tmp_path / "vlm.parquet")
    pq.write_table(table, tmp_path / "groups.parquet", row_group_size=2)
    files = [tmp_path / "vlm-000.tar", tmp_path / "groups.parquet"]
    want = [raw for f in files for raw in read_source(f)]
    index = RawIndex(files)
    assert len(index) == len(want) == 10
    assert [index.raw(i) for i in (9, 0, 4, 5, 6, 3)] == [want[i] for i in (9, 0, 4, 5, 6, 3)]
