"""Checkpoints for the evaluation tests (docs/evaluation.md): a small random model of a family
with the test HF tokenizer's vocabulary, as a DCP step folder and its Hugging Face export, and
lm-eval's per-request answers of a run."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from torchtitan.checkpoint import storage as io
from torchtitan.config.job_config import JobConfig
from torchtitan.models import MODELS

HF_TOKENIZER = "tests/assets/hf_tokenizer"
TASKS = ["torchtitan_facts_mc", "torchtitan_facts_gen"]
SEQ_LEN = 128
VOCAB = 1024  # tests/assets/hf_tokenizer


def make_checkpoint(
    root: Path, family: str = "qwen3", flavor: str = "debugmodel", args: Any = None
) -> Path:
    """``root/ckpt/step-1`` (DCP, model only) and ``root/hf`` (its HF export) of a random model
    whose weights are large enough (std 0.1) that its choices are not near ties. ``args``
    replaces the flavor's shape (then only the HF folder can be loaded by shape)."""
    spec = MODELS[family]
    base = spec.flavors[flavor] if args is None else args
    args = dataclasses.replace(base, vocab_size=VOCAB, max_seq_len=SEQ_LEN)
    with torch.device("meta"):
        model = spec.build(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)  # type: ignore[operator]
    gen = torch.Generator().manual_seed(0)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for name, _ in model.named_parameters():  # buffers (a MoE routing bias) stay as built
        if "norm" not in name:
            sd[name].normal_(0.0, 0.1, generator=gen)
    step = io.write_model_weights(root / "ckpt", 1, sd)
    adapter = spec.state_dict_adapter(args)
    assert adapter is not None
    (root / "hf").mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    save_file(adapter.to_hf(sd), str(root / "hf" / "model.safetensors"))
    (root / "hf" / "config.json").write_text(json.dumps(adapter.hf_config()))  # type: ignore[attr-defined]
    return step


def eval_config(
    checkpoint: Path, dump: Path, family: str = "qwen3", **eval_fields: Any
) -> JobConfig:
    cfg = JobConfig()
    cfg.model.name = family
    cfg.model.tokenizer_path = HF_TOKENIZER
    cfg.training.seq_len = SEQ_LEN
    cfg.job.dump_folder = str(dump)
    cfg.eval.tasks = list(TASKS)
    cfg.eval.checkpoint = str(checkpoint)
    cfg.eval.max_gen_tokens = 16
    for k, v in eval_fields.items():
        setattr(cfg.eval, k, v)
    return cfg


def answers(results: dict[str, Any]) -> dict[str, list[tuple[int, Any]]]:
    """Per task, every document's answers (``resps``) by document id."""
    return {
        task: sorted((s["doc_id"], s["resps"]) for s in samples)
        for task, samples in results["samples"].items()
    }


def max_loglikelihood_diff(a: list[tuple[int, Any]], b: list[tuple[int, Any]]) -> float:
    """Largest |difference| of the log-likelihoods of two runs' answers (same documents, same
    greedy flags asserted)."""
    assert [d for d, _ in a] == [d for d, _ in b]
    worst = 0.0
    for (_, ra), (_, rb) in zip(a, b):
        for (la, ga), (lb, gb) in zip((r[0] for r in ra), (r[0] for r in rb)):
            assert ga == gb
            worst = max(worst, abs(la - lb))
    return worst
