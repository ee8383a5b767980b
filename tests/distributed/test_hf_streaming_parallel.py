"""Hugging Face import and export under the trainer's parallel layouts (docs/hf_io.md), on 2
gloo ranks, for a checkpoint ``transformers`` wrote from a tiny config (``tiny_hf_cases``):

* import: ``checkpoint.initial_load_in_hf`` fills the parallelized model; every rank's local
  shard equals the same box of a one-process import bitwise, and the bytes the rank reads are
  exactly the bytes of its boxes (a tensor with no HF source, or a tied head whose box the
  rank already read, costs nothing);
* export, after 2 training steps: the trainer's DCP checkpoint through ``convert.to_hf`` (one
  process, the path a user runs) and ``save_hf_streaming`` from the parallelized model on the
  ranks give the same HF tensors; both re-import bitwise to the trained weights, and
  ``transformers`` loads them with logits within 1e-5 of ours.

EP 2 (Qwen3-MoE: FSDP on the dense tensors, experts split) is fast; the rest are slow."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.launcher import run_ranks
from tests.parity import DEBUG_TOML, TINY
from tests.tiny_args import tiny_hf_cases
from torchtitan import convert
from torchtitan.checkpoint.hf_io import load_hf_streaming, owned_box, save_hf_streaming
from torchtitan.checkpoint.storage import read_hf_folder
from torchtitan.models import MODELS

transformers = pytest.importorskip("transformers")

CASES = tiny_hf_cases()
VOCAB = 2048  # the test tokenizer's: the trainer sets vocab_size from it
FLAVOR = "_hf_layout"  # the case's args, registered as a flavor for the trainer
SHARD = 64 << 10  # bytes per safetensors file: several files per checkpoint
TP2 = ["--parallelism.tensor_parallel_degree", "2"]
EP2 = ["--parallelism.expert_parallel_degree", "2"]
PP2 = [
    "--parallelism.pipeline_parallel_degree",
    "2",
    "--parallelism.data_parallel_shard_degree",
    "1",
]
LAYOUTS: dict[str, tuple[str, list[str]]] = {
    # id: (tiny_hf_cases case, trainer arguments)
    "EP 2 qwen3-moe": ("qwen3-moe", EP2),
    "FSDP 2 llama3": ("llama3", []),
    "TP 2 llama3": ("llama3", TP2),
    "PP 2 llama3": ("llama3", PP2),
    "TP 2 qwen3 (tied head)": ("qwen3", TP2),
    "EP 2 deepseek_v3": ("deepseek_v3", EP2),
    "EP 2 gpt_oss": ("gpt_oss", EP2),
}
FAST = {"EP 2 qwen3-moe"}


def _args(case: str) -> tuple[str, Any]:
    family, args = CASES[case]
    return family, dataclasses.replace(args, vocab_size=VOCAB, max_seq_len=64)


def _transformers_folder(family: str, args: Any, folder: Path) -> None:
    """A ``transformers`` model of the case's config, every weight random (norms, biases and
    routers included, so a wrong permutation or a zero shows), saved in several files."""
    adapter: Any = MODELS[family].state_dict_adapter(args)
    config = adapter.hf_config()
    cls = getattr(transformers, config["architectures"][0])
    torch.manual_seed(0)
    hf = cls(cls.config_class(**config))
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3 if p.dim() == 1 else 0.05)
    hf.save_pretrained(folder, max_shard_size=SHARD)


def _our_model(family: str, args: Any, folder: Path | None = None) -> torch.nn.Module:
    """Our model in one process, streamed from ``folder`` when given."""
    model = MODELS[family].build(args)
    model.init_weights(seed=5)  # type: ignore[operator]
    if folder is not None:
        load_hf_streaming([model], MODELS[family].state_dict_adapter(args), folder)
    return model.eval()


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))


def _box_bytes(sd: dict[str, torch.Tensor], adapter: Any) -> int:
    """The bytes of this rank's boxes that have a Hugging Face source: each storage once, a
    tensor HF has no name for (zeros) nothing, a tied head whose box the rank read for the
    embedding nothing."""
    seen: set[tuple[int, tuple[int, ...]]] = set()
    boxes: dict[str, Any] = {}
    total = 0
    for key, t in sd.items():
        shape, box, local = owned_box(t)
        boxes[key] = box
        if (local.data_ptr(), tuple(local.shape)) in seen:
            continue
        seen.add((local.data_ptr(), tuple(local.shape)))
        tied = adapter.tied_to(key)
        if tied is not None:
            if boxes.get(tied) == box:
                continue
        elif not adapter.to_hf_one(key, torch.empty(shape, device="meta"), check=False):
            continue
        total += local.nbytes
    return total


def _on_ranks(argv: list[str], family: str, args: Any, folder: str, ref: Any, out: str) -> Any:
    """Build the trainer (it streams the HF folder in), compare every local shard with the
    same box of ``ref``, count this rank's read bytes (a second streaming load), train, export
    from the parallelized model; returns (differing names, bytes read, bytes of the boxes,
    the trained full tensors this rank holds)."""
    from torchtitan.checkpoint.state import model_state_dict
    from torchtitan.preflight.validate import load_config
    from torchtitan.training.trainer import Trainer

    trainer = Trainer(load_config(["--job.config_file", DEBUG_TOML, *argv]))
    try:
        adapter = MODELS[family].state_dict_adapter(args)
        sd = model_state_dict(trainer.model_parts)
        bad = [
            k for k, t in sd.items() if not torch.equal(owned_box(t)[2], ref[k][owned_box(t)[1]])
        ]
        read = load_hf_streaming(trainer.model_parts, adapter, Path(folder)).done
        trainer.train()
        sd = model_state_dict(trainer.model_parts)
        save_hf_streaming(sd, adapter, Path(out), max_shard_bytes=SHARD)
        full = {k: t.full_tensor() if hasattr(t, "full_tensor") else t for k, t in sd.items()}
        # numpy arrays travel to the parent by value (a tensor's shared memory would not)
        return bad, read, _box_bytes(sd, adapter), {k: t.numpy() for k, t in full.items()}
    finally:
        trainer.close()


def _check_export(family: str, args: Any, folder: Path, trained: dict[str, torch.Tensor]) -> float:
    """``folder`` re-imports bitwise to ``trained``; returns the max abs logit difference
    between ``transformers`` reading it and our model holding ``trained``."""
    model = _our_model(family, args, folder)
    got = model.state_dict()
    assert set(got) == set(trained), set(got) ^ set(trained)
    bad = [k for k in got if not torch.equal(got[k], trained[k])]
    assert not bad, f"{folder.name}: {len(bad)} tensors differ after re-import: {bad[:4]}"
    cls = getattr(
        transformers, json.loads((folder / "config.json").read_text())["architectures"][0]
    )
    hf = cls.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return (model(_tokens()) - hf(_tokens()).logits).abs().max().item()


@pytest.mark.parametrize(
    "layout", [pytest.param(k, marks=[] if k in FAST else [pytest.mark.slow]) for k in LAYOUTS]
)
def test_import_and_export_under_the_trainers_layout(
    layout: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    case, extra = LAYOUTS[layout]
    family, args = _args(case)
    monkeypatch.setitem(MODELS[family].flavors, FLAVOR, args)  # type: ignore[index]
    _transformers_folder(family, args, tmp_path / "hf")
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 2
    ref = _our_model(family, args, tmp_path / "hf").state_dict()
    total = sum(t.nbytes for t in read_hf_folder(tmp_path / "hf")[1].values())
    argv = [
        *TINY,
        *("--model.name", family, "--model.flavor", FLAVOR),
        *("--training.local_batch_size", "4", "--training.steps", "2"),
        *("--checkpoint.enable", "--job.dump_folder", str(tmp_path / "run")),
        *(
            "--checkpoint.initial_load_path",
            str(tmp_path / "hf"),
            "--checkpoint.initial_load_in_hf",
        ),
        *extra,
    ]
    out = tmp_path / "hf_ranks"
    results = run_ranks(_on_ranks, 2, argv, family, args, str(tmp_path / "hf"), ref, str(out))
    trained: dict[str, torch.Tensor] = {}
    for rank, (bad, read, boxes, full) in enumerate(results):
        print(
            f"{layout} rank {rank}: read {read} B = its boxes {boxes} B, {read / total:.3f} of {total}"
        )
        assert not bad, (
            f"{layout} rank {rank}: {len(bad)} shards differ from one process: {bad[:4]}"
        )
        assert read == boxes, f"{layout} rank {rank}: read {read} bytes, its boxes hold {boxes}"
        trained.update({k: torch.from_numpy(a) for k, a in full.items()})
    assert any(not torch.equal(trained[k], ref[k]) for k in ref), "training changed nothing"

    converted = tmp_path / "hf_convert"
    convert.to_hf(tmp_path / "run" / "checkpoint" / "step-2", converted, family, args, None, SHARD)
    ours, theirs = read_hf_folder(out)[1], read_hf_folder(converted)[1]
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    for folder in (out, converted):
        diff = _check_export(family, args, folder, trained)
        print(f"{layout} export {folder.name}: transformers vs ours, max abs logit diff {diff:.2e}")
        assert diff <= 1e-5, (folder.name, diff)
