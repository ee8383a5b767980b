"""Streaming Hugging Face import under parallel layouts (docs/hf_io.md): the trainer's
``checkpoint.initial_load_in_hf`` fills the sharded parameters, each rank reading only the
bytes of its shards (counted by ``SafetensorsFolder``), and the weights equal the full-load
path (``StateDictAdapter.from_hf`` on every tensor) bitwise. FSDP 2 is fast; TP 2, EP 2 and
PP 2 are slow."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.launcher import run_ranks
from tests.parity import DEBUG_TOML, TINY
from torchtitan.checkpoint.hf_io import save_hf_streaming
from torchtitan.checkpoint.storage import read_hf_folder
from torchtitan.models import MODELS

# Qwen3-MoE on Hugging Face has no shared expert: the debug MoE flavor without it, registered
# for these tests (a flavor table is read at use, docs/extending.md).
HF_MOE_FLAVOR = "debugmodel_moe_no_shared"
QWEN_MOE = ["--model.name", "qwen3", "--model.flavor", HF_MOE_FLAVOR]
LAYOUTS: dict[str, tuple[str, str, list[str], float]] = {
    # id: (family, flavor, trainer arguments, the most of the checkpoint one rank may read)
    "FSDP 2": ("llama3", "debugmodel", [], 0.5 * 1.05),
    "TP 2": ("llama3", "debugmodel", ["--parallelism.tensor_parallel_degree", "2"], 0.6),
    "PP 2": (
        "llama3",
        "debugmodel",
        [
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.data_parallel_shard_degree",
            "1",
        ],
        0.7,
    ),
    "EP 2": (
        "qwen3",
        HF_MOE_FLAVOR,
        [*QWEN_MOE, "--parallelism.expert_parallel_degree", "2"],
        0.5 * 1.05,
    ),
}


def _load_and_compare(argv: list[str], folder: str, expected: dict[str, torch.Tensor]) -> Any:
    """Build the trainer (which streams the HF weights in); re-run the streaming load to count
    this rank's bytes; the names whose full weights differ from ``expected``."""
    from torchtitan.checkpoint.hf_io import load_hf_streaming
    from torchtitan.checkpoint.state import model_state_dict
    from torchtitan.models import runtime_args
    from torchtitan.preflight.validate import load_config
    from torchtitan.trainer import Trainer

    cfg = load_config(["--job.config_file", DEBUG_TOML, *argv])
    trainer = Trainer(cfg)
    try:
        spec = MODELS[cfg.model.name]
        args = runtime_args(
            spec, cfg.model.flavor, expected["tok_embeddings.weight"].shape[0], cfg.training.seq_len
        )
        progress = load_hf_streaming(
            trainer.model_parts, spec.state_dict_adapter(args), Path(folder)
        )
        sd = model_state_dict(trainer.model_parts)
        bad = []
        for k, t in sd.items():
            full = t.full_tensor() if hasattr(t, "full_tensor") else t
            if not torch.equal(full, expected[k]):
                bad.append(k)
        return progress.done, bad, len(sd)
    finally:
        trainer.close()


def _hf_folder(family: str, flavor: str, out: Path) -> dict[str, torch.Tensor]:
    """A seeded model of ``flavor`` exported to ``out``; returns the full-load path's weights."""
    spec = MODELS[family]
    args = dataclasses.replace(spec.flavors[flavor], max_seq_len=64)
    model = spec.build(args)
    model.init_weights(seed=123)  # type: ignore[operator]
    adapter = spec.state_dict_adapter(args)
    save_hf_streaming(dict(model.state_dict()), adapter, out, max_shard_bytes=1 << 20)
    return adapter.from_hf(read_hf_folder(out)[1])


@pytest.mark.parametrize(
    "layout",
    [pytest.param(k, marks=[] if k == "FSDP 2" else [pytest.mark.slow]) for k in LAYOUTS],
)
def test_each_rank_reads_only_its_shards_and_equals_the_full_load(
    layout: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    flavors = MODELS["qwen3"].flavors
    moe = flavors["debugmodel_moe"]
    no_shared = dataclasses.replace(moe, moe=dataclasses.replace(moe.moe, num_shared_experts=0))
    monkeypatch.setitem(flavors, HF_MOE_FLAVOR, no_shared)  # type: ignore[index]
    family, flavor, extra, most = LAYOUTS[layout]
    expected = _hf_folder(family, flavor, tmp_path / "hf")
    total = sum(t.nbytes for t in read_hf_folder(tmp_path / "hf")[1].values())
    argv = [
        *TINY,
        "--training.local_batch_size",
        "4",
        "--checkpoint.enable",
        "--job.dump_folder",
        str(tmp_path / "run"),
        "--checkpoint.initial_load_path",
        str(tmp_path / "hf"),
        "--checkpoint.initial_load_in_hf",
        *extra,
    ]
    results = run_ranks(_load_and_compare, 2, argv, str(tmp_path / "hf"), expected)
    for rank, (read, bad, n) in enumerate(results):
        print(f"{layout} rank {rank}: read {read} of {total} bytes ({read / total:.3f})")
        assert not bad, f"{layout} rank {rank}: {len(bad)}/{n} tensors differ: {bad[:4]}"
        assert 0 < read <= most * total, (layout, rank, read, total)
