"""Evaluation streams each rank's weights (docs/evaluation.md, "Parallelism"): under tensor
parallel 2 a rank reads about half of a Hugging Face folder's bytes and DCP loads only its
shards, and the split model's logits equal the one-process model's (docs/evaluation.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.launcher import run_ranks
from tests.tiny_args import tiny_llama3
from torchtitan.checkpoint import hf_io
from torchtitan.checkpoint.storage import write_model_weights
from torchtitan.models import MODELS

ARGS = tiny_llama3(dim=128, heads=(8, 4), vocab=256, n_layers=2, max_seq_len=32)


def _tokens() -> torch.Tensor:
    return torch.randint(0, ARGS.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))


def _rank(path: str, hf: bool, tp: int) -> tuple[list, int]:
    from torchtitan.config.manager import parse_args
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.eval.loading import checkpoint_args, load_eval_model

    read = []
    real = hf_io.load_hf_streaming

    def counted(*a: Any, **k: Any) -> hf_io.Progress:
        progress = real(*a, **k)
        read.append(progress.done)
        return progress

    hf_io.load_hf_streaming = counted  # type: ignore[assignment]
    device, world, _ = dist_utils.init_distributed(60)
    dims = ParallelDims(dp_replicate=world // tp, dp_shard=1, cp=1, tp=tp, pp=1, world_size=world)
    dims.build_mesh(device.type)
    cfg = parse_args(["--model.name", "llama3", "--parallelism.tensor_parallel_degree", str(tp)])
    family, args = checkpoint_args(Path(path), hf, "llama3", "tiny")
    model = load_eval_model(Path(path), hf, family, args, dims, cfg, device, torch.float32)
    with torch.no_grad():
        logits = model(_tokens())
    full = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    dist_utils.destroy_distributed()
    return full.tolist(), sum(read)


def test_tp2_reads_its_shards_and_equals_one_process(tmp_path: Path, monkeypatch: Any) -> None:
    spec = MODELS["llama3"]
    monkeypatch.setitem(spec.flavors, "tiny", ARGS)  # type: ignore[index]
    model = spec.build(ARGS)
    model.init_weights(seed=0)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    hf_io.save_hf_streaming(sd, spec.state_dict_adapter(ARGS), tmp_path / "hf")
    step = write_model_weights(tmp_path / "dcp", 1, sd)
    model.init_buffers()  # type: ignore[operator]
    with torch.no_grad():
        want = model(_tokens())
    total = sum(v.numel() * v.element_size() for v in sd.values())
    for path, hf in ((tmp_path / "hf", True), (step, False)):
        results = run_ranks(_rank, 2, str(path), hf, 2)
        for logits, nbytes in results:
            diff = (torch.tensor(logits) - want).abs().max().item()
            assert diff <= 1e-5 * want.abs().max().item(), (path.name, diff)
            if hf:  # each rank reads its shards: half the matrices, the norms whole
                print(f"TP 2: a rank read {nbytes:,} of {total:,} bytes")
                assert nbytes < 0.6 * total, (nbytes, total)
