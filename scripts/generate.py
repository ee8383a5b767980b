"""Sample text from a trained checkpoint, with a KV cache, on CPU or GPU, optionally with TP.

    python scripts/generate.py outputs/debug_model/checkpoint --prompt "Once upon a time"
    python scripts/generate.py hf_folder --hf --prompt "..." --temperature 0.8 --top_k 50
    torchrun --nproc_per_node 2 scripts/generate.py CKPT --tp 2 --prompt "..."

``CKPT`` is a ``step-N`` folder written by the trainer (only its model weights are read), or the
checkpoint root holding them (the newest valid one is used), or with ``--hf`` a Hugging Face
folder (``config.json`` + ``*.safetensors``, read through the state-dict adapter of the family
its ``model_type`` names: Llama 3, Qwen3, Qwen3-MoE, GPT-OSS, DeepSeek-V3). The model shape comes from
``--model`` and ``--flavor`` (DCP; the vocabulary size from the weights) or from ``config.json`` (HF). Sampling: greedy (``--temperature 0``, the default), or softmax at a
temperature, optionally restricted to the ``--top_k`` most likely tokens; ``--seed`` makes
sampling reproducible. ``--no_kv_cache`` recomputes the whole prefix for every token (slow;
it exists to check the cache). With ``--tp N`` (under torchrun, N ranks) the model is split
with the training TP plan and every rank samples the same tokens. See docs/generation.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torchtitan.config.errors import ConfigError
from torchtitan.data.tokenizer import build_tokenizer
from torchtitan.distributed.utils import device_type
from torchtitan.eval.loading import load_weights as read_weights
from torchtitan.eval.loading import materialize
from torchtitan.models import MODELS
from torchtitan.models.common.kv_cache import KVCache

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ---------------------------------------------------------------- weights
def load_weights(
    path: Path, hf: bool, flavor: str, model: str = "llama3"
) -> tuple[Any, dict[str, torch.Tensor]]:
    """(model args, full native state dict) of a step-N folder, a checkpoint root (its newest
    valid step) or a Hugging Face folder (the family from its config.json): eval/loading.py's
    reader."""
    _, args, sd = read_weights(path, hf, model, flavor)
    return args, sd


def build_model(
    args: Any,
    sd: dict[str, torch.Tensor],
    device: torch.device,
    dtype: torch.dtype,
    tp: int = 1,
    model_name: str = "llama3",
) -> nn.Module:
    """The model with ``sd`` loaded, in eval mode; split over a ``tp`` mesh when ``tp > 1``.
    ``model_name``: the family (``MODELS``) that ``args`` belong to."""
    spec = MODELS[model_name]
    with torch.device("meta"):
        model = spec.build(args)
    if tp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        from torchtitan.distributed.tensor_parallel import apply_tp

        mesh = init_device_mesh(device.type, (tp,), mesh_dim_names=("tp",))
        # Logits gathered to every rank (no loss parallel): each rank samples from them.
        plan = spec.parallel_plan(args)
        apply_tp(model, plan.blocks_of(model), mesh, plan.tensor_parallel, loss_parallel=False)
    return materialize(model, sd, device, dtype, sharded=tp > 1)


# ---------------------------------------------------------------- sampling
def sample_next(
    logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator | None
) -> torch.Tensor:
    """Next token ids ``[B]`` from last-position logits ``[B, vocab]``."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    # Sample on the CPU generator so that the same seed gives the same tokens on any device.
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int = 0,
    use_cache: bool = True,
    eos_id: int | None = None,
    tp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """``prompt`` ``[B, S]`` followed by up to ``max_new_tokens`` sampled ids (``[B, S + n]``).

    With ``use_cache`` the prompt is run once (the prefill) and each new token is one forward
    of a single position; without it every step recomputes the whole sequence. Generation stops
    early when every row has produced ``eos_id``. Under TP (``tp_group``) rank 0's token is
    broadcast so all ranks continue the same sequence.
    """
    generator = torch.Generator().manual_seed(seed) if temperature > 0 else None
    device = prompt.device
    tokens = prompt
    cache = KVCache(prompt.shape[1] + max_new_tokens) if use_cache else None
    done = torch.zeros(prompt.shape[0], dtype=torch.bool, device=device)
    for _ in range(max_new_tokens):
        if cache is None:
            logits = model(tokens)
        else:
            new = tokens[:, cache.length :]
            positions = torch.arange(cache.length, tokens.shape[1], device=device)
            logits = model(new, positions=positions, cache=cache)
        nxt = sample_next(logits[:, -1], temperature, top_k, generator)
        if tp_group is not None:
            dist.broadcast(nxt, group_src=0, group=tp_group)
        if eos_id is not None:
            nxt = torch.where(done, eos_id, nxt)
            done |= nxt == eos_id
        tokens = torch.cat([tokens, nxt[:, None]], dim=1)
        if eos_id is not None and bool(done.all()):
            break
    return tokens


# ---------------------------------------------------------------- command line
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("checkpoint", type=Path, help="step-N folder, checkpoint root, or HF folder")
    p.add_argument("--hf", action="store_true", help="the checkpoint is a Hugging Face folder")
    p.add_argument("--model", default="llama3", choices=sorted(MODELS), help="family (DCP)")
    p.add_argument("--flavor", default="debugmodel", help="a flavor of --model (DCP)")
    p.add_argument("--tokenizer", default="tests/assets/tokenizer", help="model.tokenizer_path")
    p.add_argument("--prompt", default="", help="text to continue (BOS is prepended)")
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top_k", type=int, default=0, help="sample among the k likeliest; 0: all")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop_at_eos", action="store_true", help="stop after the EOS token")
    p.add_argument("--no_kv_cache", action="store_true", help="recompute the prefix each step")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel degree (under torchrun)")
    p.add_argument(
        "--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: detected"
    )
    p.add_argument("--dtype", default="auto", choices=["auto", *_DTYPES])
    p.add_argument("--json", action="store_true", help="print one JSON object (ids and text)")
    a = p.parse_args(argv)
    if a.max_new_tokens < 1 or a.top_k < 0 or a.temperature < 0:
        p.error("--max_new_tokens must be >= 1, --top_k >= 0 and --temperature >= 0")

    dev_type = a.device if a.device != "auto" else device_type()  # TORCHTITAN_DEVICE overrides
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if a.tp != world:
        p.error(
            f"--tp {a.tp} needs exactly {a.tp} processes (torchrun --nproc_per_node {a.tp}); got {world}"
        )
    rank = 0
    if a.tp > 1:
        dist.init_process_group("nccl" if dev_type == "cuda" else "gloo")
        rank = dist.get_rank()
    device = torch.device("cpu")
    if dev_type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dtype = (
        (torch.bfloat16 if dev_type == "cuda" else torch.float32)
        if a.dtype == "auto"
        else _DTYPES[a.dtype]
    )

    tokenizer = build_tokenizer(a.tokenizer)
    if not a.hf and a.flavor not in MODELS[a.model].flavors:
        p.error(f"--flavor {a.flavor} is not one of {sorted(MODELS[a.model].flavors)}")
    # From an HF folder the family comes from its config.json.
    try:
        a.model, args, sd = read_weights(a.checkpoint, a.hf, a.model, a.flavor)
    except ConfigError as e:  # a config.json key we cannot compute (docs/hf_io.md): exit 2
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if tokenizer.vocab_size > args.vocab_size:
        p.error(
            f"the tokenizer has {tokenizer.vocab_size} tokens, the model only {args.vocab_size}"
        )
    ids = tokenizer.encode(a.prompt, bos=True, eos=False)
    args = dataclasses.replace(args, max_seq_len=max(args.max_seq_len, len(ids) + a.max_new_tokens))
    model = build_model(args, sd, device, dtype, tp=a.tp, model_name=a.model)
    del sd

    prompt = torch.tensor([ids], dtype=torch.long, device=device)
    t0 = time.perf_counter()
    out = generate(
        model,
        prompt,
        a.max_new_tokens,
        temperature=a.temperature,
        top_k=a.top_k,
        seed=a.seed,
        use_cache=not a.no_kv_cache,
        eos_id=tokenizer.eos_id if a.stop_at_eos else None,
        tp_group=dist.group.WORLD if a.tp > 1 else None,
    )
    elapsed = time.perf_counter() - t0
    new_ids = out[0, len(ids) :].tolist()
    if rank == 0:
        text = tokenizer.decode(new_ids)
        if a.json:
            print(json.dumps({"prompt_ids": ids, "ids": new_ids, "text": text, "seconds": elapsed}))
        else:
            print(a.prompt + text)
            print(
                f"[{len(new_ids)} tokens in {elapsed:.2f} s, {len(new_ids) / elapsed:.1f} tokens/s; "
                f"{'KV cache' if not a.no_kv_cache else 'no cache'}, {device}, {dtype}, tp {a.tp}]",
                file=sys.stderr,
            )
    if a.tp > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
