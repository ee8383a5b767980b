"""Per-rank memory estimate of a training job, before anything is allocated.

The estimate follows one optimizer step of the rank that needs the most memory and takes the
largest of these moments (each is ``state`` + what is live only then):

* ``loss backward``: every saved activation of the in-flight microbatches, the head's
  log-softmax output and the two logits-sized gradients of the cross-entropy backward;
* ``block backward`` (each transformer block, last to first): the saved activations of the
  blocks below it, the block's own activations (recomputed under activation checkpointing), the
  gradient working set of the block, and the gradients produced so far;
* ``optimizer step``: parameters, gradients and both AdamW moments.

``state`` is what lives all step: the parameter shards (fp32 master weights, or bf16), the AdamW moments
(two fp32 tensors per parameter shard), the gradients carried between gradient-accumulation
microbatches, pipeline receive buffers, and, while forward/backward runs, the parameters FSDP
has all-gathered (in the mixed-precision param dtype, or float8 with float8 all-gather).

Activation sizes are counted per token and per block from what autograd saves in
``torchtitan/models/llama3/model.py`` (measured with ``saved_tensors_hooks``): with ``d`` the
model width, ``h`` the SwiGLU width and ``H`` the heads, a block saves ``10 d + 4 h`` values in the
compute dtype (block input, the two norms' normalized inputs and outputs, q/k/v, the attention
output, the residual, and four ``h``-wide SwiGLU tensors) plus ``2 + H`` fp32 values (RMS
statistics, attention log-sum-exp). Tensor parallel with sequence parallel divides all but the
two all-gathered block inputs by ``tp``; context parallel divides the tokens by ``cp`` but
saves the all-gathered K/V at full length. Full AC keeps only each block's input; op-level
selective AC keeps the outputs it marks MUST_SAVE (attention, every second matmul).

The fixed ``temporaries`` allowance stands for what no tensor count sees: kernel workspaces,
communication buffers and allocator fragmentation. ``tests/unit/test_estimator.py`` checks the
rest (``tensor_peak``) against the measured peak of live tensor memory; docs/planning.md lists
the measured errors.
"""

from __future__ import annotations

from torchtitan.config.job_config import JobConfig
from torchtitan.data.tokenizer import build_tokenizer
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models import MODELS, flavor_of, run_args
from torchtitan.models.spec import DecoderShape as ModelArgs
from torchtitan.planner.memory_terms import (
    GIB,
    MemoryEstimate,
    block_activation_bytes,
    block_params,
    format_bytes,
    in_flight_microbatches,
    loss_working_set,
    master_weight_bytes,
    optimizer_state_bytes_per_param,
    param_dtype_bytes,
)
from torchtitan.planner.rank_memory import RankMemory
from torchtitan.preflight.validate import pipeline_stages

__all__ = [
    "GIB",
    "MemoryEstimate",
    "block_activation_bytes",
    "block_params",
    "estimate_memory",
    "format_bytes",
    "in_flight_microbatches",
    "loss_working_set",
    "master_weight_bytes",
    "model_args_for",
    "optimizer_state_bytes_per_param",
    "param_dtype_bytes",
    "resolve_vocab_size",
]


def resolve_vocab_size(cfg: JobConfig, args: ModelArgs) -> int:
    """The tokenizer's vocabulary (what the trainer uses) if the tokenizer loads, else the flavor's."""
    try:
        return int(build_tokenizer(cfg.model.tokenizer_path).vocab_size)
    except Exception:  # noqa: BLE001 - a missing tokenizer falls back to the flavor's size
        return args.vocab_size


def model_args_for(cfg: JobConfig, vocab_size: int | None = None) -> ModelArgs:
    """The args the trainer would build (``models.run_args``: the flavor, an HF folder's
    settings, the ``model.moe_*`` and ``model.mtp_*`` overrides), typed as the decoder shape
    this estimator models."""
    spec = MODELS[cfg.model.name]
    vocab = (
        resolve_vocab_size(cfg, spec.flavors[flavor_of(cfg)]) if vocab_size is None else vocab_size
    )
    shape: ModelArgs = run_args(cfg, vocab)
    return shape


def estimate_memory(
    cfg: JobConfig,
    world_size: int,
    *,
    device_type: str = "cuda",
    model_args: ModelArgs | None = None,
    temporaries_bytes: int | None = None,
    steady_state: bool = True,
    pp_rank: int | None = None,
) -> MemoryEstimate:
    """Peak per-rank memory of ``cfg`` on ``world_size`` ranks of ``device_type``.

    ``model_args``: the model shape (default: the config's flavor with the tokenizer's
    vocabulary). ``temporaries_bytes``: the fixed allowance (default 1 GiB on CUDA, 0 on CPU,
    where no caching allocator or communication library holds memory of its own).
    ``steady_state``: count the optimizer moments (false: the first step, before they exist).
    ``pp_rank``: estimate this pipeline rank (default: the one that needs the most memory).
    """
    a = model_args or model_args_for(cfg)
    dims = ParallelDims.from_config(cfg.parallelism, world_size)
    plan = pipeline_stages(cfg)
    estimates = [
        RankMemory(cfg, a, dims, plan, r, device_type, steady_state).estimate()
        for r in (range(dims.pp if plan else 1) if pp_rank is None else [pp_rank])
    ]
    best = max(estimates, key=lambda e: e.total)
    best.temporaries = (
        temporaries_bytes
        if temporaries_bytes is not None
        else (GIB if device_type == "cuda" else 0)
    )
    return best
