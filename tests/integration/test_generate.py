"""Generation from a trained debug checkpoint: deterministic, KV cache exact, HF and TP agree.

One module-scoped run trains the debug model for 20 steps on one rank with checkpointing on;
every test then generates from its ``step-20`` folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.parity import train_metrics
from tests.script_loader import load

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "Once upon a time"
NEW_TOKENS = 24


gen = load("scripts/generate.py")


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    # A tiny model: per-op overhead dominates, and a second intra-op thread on a shared CPU
    # makes each op wait for it (measured 30x slower under load).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dump = tmp_path_factory.mktemp("gen_train")
    overrides = [
        "--training.local_batch_size",
        "4",
        "--training.global_batch_size",
        "4",
        "--training.seq_len",
        "32",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "20",
    ]
    metrics = train_metrics(overrides, world_size=1, dump=dump, steps=20)
    assert metrics[-1]["step"] == 20 and metrics[-1]["loss"] < metrics[0]["loss"] - 1.0
    folder = dump / "checkpoint" / "step-20"
    assert (folder / ".metadata").is_file()
    return folder


def _prompt() -> torch.Tensor:
    from torchtitan.data.tokenizer import build_tokenizer

    ids = build_tokenizer("tests/assets/tokenizer").encode(PROMPT, bos=True, eos=False)
    return torch.tensor([ids])


def _model(checkpoint: Path) -> torch.nn.Module:
    args, sd = gen.load_weights(checkpoint, hf=False, flavor="debugmodel")
    return gen.build_model(args, sd, torch.device("cpu"), torch.float32)


def test_greedy_deterministic_and_kv_cache_exact(checkpoint: Path) -> None:
    model = _model(checkpoint)
    prompt = _prompt()
    a = gen.generate(model, prompt, NEW_TOKENS)
    b = gen.generate(model, prompt, NEW_TOKENS)
    recomputed = gen.generate(model, prompt, NEW_TOKENS, use_cache=False)
    print("greedy ids:", a[0, prompt.shape[1] :].tolist())
    assert a.shape == (1, prompt.shape[1] + NEW_TOKENS)
    assert torch.equal(a, b), "two greedy runs differ"
    assert torch.equal(a, recomputed), "KV-cache generation differs from recomputation"

    # The logits themselves: prefill + one-token decodes through the cache vs one full forward.
    from torchtitan.models.common.kv_cache import KVCache

    with torch.no_grad():
        full = model(a)
        cache = KVCache(a.shape[1])
        n = prompt.shape[1]
        steps = [model(a[:, :n], torch.arange(n), cache)]
        for pos in range(n, a.shape[1]):
            steps.append(model(a[:, pos : pos + 1], torch.tensor([pos]), cache))
        # A chunk of several positions after the prefix exercises the offset causal mask.
        chunked = KVCache(a.shape[1])
        first = model(a[:, :n], torch.arange(n), chunked)
        rest = model(a[:, n:], torch.arange(n, a.shape[1]), chunked)
    worst = (torch.cat(steps, dim=1) - full).abs().max().item()
    worst_chunk = (torch.cat([first, rest], dim=1) - full).abs().max().item()
    print(f"max |logit difference| cache vs full: {worst:.2e}; chunked: {worst_chunk:.2e}")
    assert worst < 1e-4 and worst_chunk < 1e-4


def test_sampling_seeded_and_top_k(checkpoint: Path) -> None:
    model = _model(checkpoint)
    prompt = _prompt()
    greedy = gen.generate(model, prompt, NEW_TOKENS)
    s1 = gen.generate(model, prompt, NEW_TOKENS, temperature=1.0, top_k=50, seed=1)
    s1_again = gen.generate(model, prompt, NEW_TOKENS, temperature=1.0, top_k=50, seed=1)
    s2 = gen.generate(model, prompt, NEW_TOKENS, temperature=1.0, top_k=50, seed=2)
    assert torch.equal(s1, s1_again), "same seed, different samples"
    assert not torch.equal(s1, s2), "different seeds gave the same 24 sampled tokens"
    assert not torch.equal(s1, greedy)
    # top_k 1 leaves one candidate: sampling becomes greedy whatever the temperature.
    top1 = gen.generate(model, prompt, NEW_TOKENS, temperature=5.0, top_k=1, seed=3)
    assert torch.equal(top1, greedy)
    # Every sampled token is among the 50 likeliest at its position.
    with torch.no_grad():
        logits = model(s1[:, :-1])[0, prompt.shape[1] - 1 :]
    top50 = torch.topk(logits, 50, dim=-1).indices
    chosen = s1[0, prompt.shape[1] :]
    assert bool((top50 == chosen[:, None]).any(dim=-1).all())


def _cli(args: list[str], nproc: int = 1) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    launcher = (
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
        + ["--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0"]
        if nproc > 1
        else [sys.executable]
    )
    cmd = [*launcher, str(ROOT / "scripts" / "generate.py"), *args, "--json"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_cli_from_hugging_face_export(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The DCP checkpoint exported to HF and generated from by the command line: same tokens."""
    convert = load("scripts/convert_to_hf.py")
    from torchtitan.models.llama3.args import LLAMA3_FLAVORS

    convert.convert(checkpoint, tmp_path, LLAMA3_FLAVORS["debugmodel"], torch.float32, 4096)
    argv = [str(tmp_path), "--hf", "--prompt", PROMPT, "--max_new_tokens", str(NEW_TOKENS)]
    assert gen.main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ref = gen.generate(_model(checkpoint), _prompt(), NEW_TOKENS)[0, _prompt().shape[1] :]
    print("HF CLI ids:", out["ids"])
    assert out["ids"] == ref.tolist()


@pytest.mark.slow
def test_tp2_matches_one_process(checkpoint: Path) -> None:
    """torchrun --nproc_per_node 2 ... --tp 2: the training TP plan, the same greedy tokens."""
    args = [str(checkpoint.parent), "--prompt", PROMPT, "--max_new_tokens", str(NEW_TOKENS)]
    tp = _cli([*args, "--tp", "2"], nproc=2)
    ref = gen.generate(_model(checkpoint), _prompt(), NEW_TOKENS)[0, _prompt().shape[1] :]
    print("TP 2 ids:", tp["ids"])
    assert tp["ids"] == ref.tolist()
