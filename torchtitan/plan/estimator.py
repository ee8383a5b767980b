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

import dataclasses
import math
from dataclasses import dataclass, field

from torchtitan.components.tokenizer import build_tokenizer
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.activation_checkpoint import parse_selective_option
from torchtitan.distributed.data_parallel import reshard_policy
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.pipeline_plan import SCHEDULES, PipelinePlan
from torchtitan.distributed.utils import resolve_dtype
from torchtitan.models import MODELS, runtime_args
from torchtitan.models.spec import DecoderShape as ModelArgs
from torchtitan.plan import moe_memory as moe_terms
from torchtitan.preflight.validate import pipeline_plan

GIB = 1024**3


@dataclass
class MemoryEstimate:
    """Bytes on one rank (the pipeline rank ``pp_rank`` that needs the most) at its peak moment."""

    parameters: int
    """Parameter shards as stored (fp32 or bf16 master weights; 0 under CPU offload), all of this rank's stages."""
    gradients: int
    """Gradients alive at the peak (sharded like the parameters; none before the first backward
    produces them, all of them during the optimizer step)."""
    optimizer_states: int
    """AdamW/Adam: two moments (fp32 or bf16) per parameter element of the shard; 0 under CPU offload."""
    activations: int
    """Saved activations of every in-flight microbatch at the peak."""
    unsharded_parameters: int
    """Parameters all-gathered by FSDP (or cast by autocast) and alive at the peak."""
    working_set: int
    """Short-lived tensors of the peak moment: logits-sized loss gradients, a block's backward
    gradients, gradients not yet reduce-scattered."""
    pipeline_buffers: int
    """Pipeline receive buffers for activations and gradients (one per microbatch)."""
    temporaries: int
    """Fixed allowance for kernel workspaces, communication buffers and fragmentation."""
    phase: str
    """The moment of the peak: 'loss backward', 'block backward (layer N)' or 'optimizer step'."""
    pp_rank: int = 0
    in_flight_microbatches: int = 1
    per_microbatch_activations: int = 0
    """Saved activations of one microbatch on this rank's stages (no AC recompute included)."""
    notes: list[str] = field(default_factory=list)
    host: int = 0
    """Bytes kept in host memory instead (FSDP CPU offload: parameter and gradient shards and the
    optimizer state); not part of ``total``."""

    @property
    def tensor_peak(self) -> int:
        """Everything but the allowance: what a live-tensor tracker measures."""
        return self.total - self.temporaries

    @property
    def total(self) -> int:
        return (
            self.parameters
            + self.gradients
            + self.optimizer_states
            + self.activations
            + self.unsharded_parameters
            + self.working_set
            + self.pipeline_buffers
            + self.temporaries
        )

    def rows(self) -> list[tuple[str, int]]:
        names = [f.name for f in dataclasses.fields(self)][:8]
        return [(n.replace("_", " "), int(getattr(self, n))) for n in names] + [
            ("total", self.total)
        ]

    def table(self) -> str:
        """A small text table in GiB (MiB below 1 GiB)."""
        lines = [f"{name:>22}: {format_bytes(n)}" for name, n in self.rows()]
        lines.append(
            f"{'peak':>22}: {self.phase} on pp rank {self.pp_rank} "
            f"({self.in_flight_microbatches} microbatch(es) in flight)"
        )
        return "\n".join(lines)


def format_bytes(n: float) -> str:
    if abs(n) >= GIB:
        return f"{n / GIB:.2f} GiB"
    return f"{n / 1024**2:.1f} MiB"


# ---------------------------------------------------------------------- model shapes
@dataclass(frozen=True)
class _Shapes:
    """Parameter tensors of a stage, as (dim0, dim1) after tensor parallel."""

    block: tuple[tuple[int, int], ...]
    block_linear: tuple[bool, ...]
    embedding: tuple[int, int]
    head: tuple[tuple[int, int], ...]


def _shapes(a: ModelArgs, tp: int) -> _Shapes:
    d, hd, hid = a.dim, a.head_dim, a.hidden_dim
    q, kv = a.n_heads * hd // tp, a.kv_heads * hd // tp
    linears = [(q, d), (kv, d), (kv, d), (d, q), (hid // tp, d), (d, hid // tp), (hid // tp, d)]
    block = tuple(linears + [(d, 1), (d, 1)])  # and the two RMSNorm weights (replicated)
    return _Shapes(
        block=block,
        block_linear=(True,) * 7 + (False, False),
        embedding=(a.vocab_size // tp, d),
        head=((d, 1), (a.vocab_size // tp, d)),
    )


def block_params(a: ModelArgs) -> int:
    """Parameters of one block (the planner weighs compute and pipeline stages with it)."""
    return _full(_shapes(a, 1).block)


def _shard_elems(shape: tuple[int, int], n: int) -> int:
    """FSDP2 shards dim 0 over ``n`` ranks, padding it to a multiple of ``n``."""
    return math.ceil(shape[0] / n) * shape[1]


def _full(shapes: tuple[tuple[int, int], ...]) -> int:
    return sum(a * b for a, b in shapes)


# ---------------------------------------------------------------------- activations
def block_activation_bytes(
    a: ModelArgs, tokens: int, act_bytes: int, tp: int, cp: int, mode: str
) -> int:
    """Bytes autograd saves for one block over ``tokens`` local tokens (already / cp).

    ``mode``: 'none' (everything), 'full' (the block input only) or 'op' (op-level SAC)."""
    d, hid, heads = a.dim, a.hidden_dim, a.n_heads
    kv_width = a.kv_heads * a.head_dim
    seq_sharded = d / tp  # sequence-parallel tensors: [tokens / tp, d] per rank
    gathered = float(d if tp > 1 else 0)  # all-gathered block inputs: [tokens, d]
    if mode == "full":
        return int(tokens * seq_sharded * act_bytes)
    if mode == "op":
        # block input, wq / wv / w1 outputs, attention output, w2 output (full sequence under
        # TP: the partial sums before the reduce-scatter), reduce-scatter outputs (TP).
        elems = seq_sharded + (d + kv_width + d + hid) / tp + d
        if tp > 1:
            elems += 2 * seq_sharded
        return int(tokens * (elems * act_bytes + heads / tp * 4))
    # none: x, normed x, h, normed h (sequence-sharded); the norm outputs (gathered under TP;
    # without TP the norm output is a tensor of its own); q, k, v (k and v at full sequence
    # under CP), attention output; four SwiGLU tensors.
    norms = 4 * seq_sharded + (2 * gathered if tp > 1 else 2 * d)
    # Under CP the attention output is a concatenation of two chunks, so the input of wo is a
    # copy of its own (without CP it shares the attention output's storage).
    attention = (d + 2 * d * cp + d + (d if cp > 1 else 0)) / tp
    ffn = 4 * hid / tp
    fp32_stats = 2 / (tp if tp > 1 else 1) + heads / tp
    return int(tokens * ((norms + attention + ffn) * act_bytes + fp32_stats * 4))


def norm_upcast_bytes(a: ModelArgs, tokens: int, act_bytes: int, tp: int, device_type: str) -> int:
    """Extra bytes one saved RMSNorm costs on CPU with a low-precision input: torch's composite
    (unfused) RMSNorm there saves its input and normalized input upcast to fp32, 4 bytes per
    element more than the compute-dtype copies the formulas count (measured with
    ``saved_tensors_hooks``; CUDA's fused kernel saves the input and the fp32 statistics only)."""
    if device_type != "cpu" or act_bytes >= 4:
        return 0
    return int(tokens * a.dim / tp * 4)


def _layer_activations(
    a: ModelArgs,
    layer: int,
    tokens: int,
    act_bytes: int,
    dims: ParallelDims,
    mode: str,
    device_type: str,
) -> int:
    """Saved bytes of block ``layer``: the dense formula, plus QK-norm's tensors and an MoE
    feed-forward in place of the SwiGLU where the model has them (``moe_memory.py``), plus the
    two norms' fp32 copies on CPU in low precision (recomputed under full and op-level AC)."""
    upcast = 2 * norm_upcast_bytes(a, tokens, act_bytes, dims.tp, device_type)
    return (
        block_activation_bytes(a, tokens, act_bytes, dims.tp, dims.cp, mode)
        + (upcast if mode == "none" else 0)
        + moe_terms.qk_norm_activation_bytes(a, tokens, act_bytes, dims.tp, mode)
        + moe_terms.moe_activation_delta(a, layer, tokens, act_bytes, dims.tp, mode, dims.ep)
    )


def block_backward_bytes(a: ModelArgs, tokens: int, act_bytes: int, tp: int) -> int:
    """Gradient working set while one block runs backward: the incoming gradient and the
    gradient of its input (at full sequence length under tensor parallel, where the sequence-
    parallel all-gathers turn into reduce-scatters), and two SwiGLU-wide gradients."""
    return int(tokens * (2 * a.dim + 2 * a.hidden_dim / tp) * act_bytes)


def _block_ids(units: list[str], blocks: str) -> list[int]:
    return [int(u.rpartition(".")[2]) for u in units if u.startswith(f"{blocks}.")]


def _checkpointed(layer: int, mode: str, option: int | str) -> str:
    """AC treatment of a block: 'none', 'full' or 'op'."""
    if mode == "full":
        return "full"
    if mode == "selective":
        if option == "op":
            return "op"
        assert isinstance(option, int)
        return "full" if (layer + 1) % option == 0 else "none"
    return "none"


def in_flight_microbatches(plan: PipelinePlan | None, pp_rank: int) -> int:
    """Microbatch-stages whose activations a pipeline rank holds at its peak, per schedule."""
    if plan is None:
        return 1
    p, n, v = plan.pp_degree, plan.n_microbatches, plan.stages_per_rank
    name = plan.schedule
    if name == "GPipe":
        return n
    if name == "LoopedBFS":
        return n * v
    if name == "1F1B":
        return min(n, p - pp_rank)
    if SCHEDULES[name].v_shaped:
        return min(n * v, 2 * (p - pp_rank) + 1)
    # Interleaved1F1B / InterleavedZeroBubble: torch's warm-up count, plus the first steady
    # forward.
    rounds = min(n, p)
    warmup = (v - 1) * rounds + 2 * (p - 1 - pp_rank)
    return min(n * v, warmup + 1)


# ---------------------------------------------------------------------- the estimate
def resolve_vocab_size(cfg: JobConfig, args: ModelArgs) -> int:
    """The tokenizer's vocabulary (what the trainer uses) if the tokenizer loads, else the flavor's."""
    try:
        return int(build_tokenizer(cfg.model.tokenizer_path).vocab_size)
    except Exception:  # noqa: BLE001 - a missing tokenizer falls back to the flavor's size
        return args.vocab_size


def model_args_for(cfg: JobConfig, vocab_size: int | None = None) -> ModelArgs:
    """The args the trainer would build (``runtime_args``), typed as the decoder shape this
    estimator models."""
    spec = MODELS[cfg.model.name]
    vocab = (
        resolve_vocab_size(cfg, spec.flavors[cfg.model.flavor])
        if vocab_size is None
        else vocab_size
    )
    args: ModelArgs = runtime_args(spec, cfg.model.flavor, vocab, cfg.training.seq_len)
    return args


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
    plan = pipeline_plan(cfg)
    estimates = [
        _estimate_rank(cfg, a, dims, plan, r, device_type, steady_state)
        for r in (range(dims.pp if plan else 1) if pp_rank is None else [pp_rank])
    ]
    best = max(estimates, key=lambda e: e.total)
    best.temporaries = (
        temporaries_bytes
        if temporaries_bytes is not None
        else (GIB if device_type == "cuda" else 0)
    )
    return best


def optimizer_state_bytes_per_param(moments_dtype: str) -> int:
    """Bytes of AdamW/Adam state per parameter element: two moments (docs/memory.md)."""
    return 2 * (2 if moments_dtype == "bfloat16" else 4)


def master_weight_bytes(cfg: JobConfig) -> int:
    """Bytes per stored parameter element (and per gradient element): fp32 or bf16."""
    return 2 if cfg.optimizer.master_weights_dtype == "bfloat16" else 4


def param_dtype_bytes(cfg: JobConfig, device_type: str) -> int:
    if cfg.optimizer.master_weights_dtype == "bfloat16":
        return 2  # the trainer computes in bf16 with bf16 master weights
    return resolve_dtype(cfg.training.mixed_precision_param, device_type).itemsize


def loss_working_set(
    tokens: int, vocab: int, act: int, chunk: int, dim: int = 0, grad_bytes: int = 4
) -> tuple[int, int]:
    """(saved per microbatch, working set at the loss backward) of the cross-entropy over
    ``tokens`` local tokens and a ``vocab``-wide (local) vocabulary.

    Whole logits: forward saves the fp32 log-softmax (``tokens x vocab``) and backward adds two
    fp32 gradients of that size; the low-precision logits gradient comes after the log-softmax
    and its incoming gradient are freed, so it is never live with them (measured). Chunked
    (``chunk`` > 0, docs/memory.md): nothing vocabulary-wide is saved; backward recomputes one
    chunk at a time (its ``C = min(chunk, tokens)`` rows), and the largest of two moments of a
    chunk's backward counts, measured with ``LiveTensorTracker`` (docs/planning.md):

    * the log-softmax backward: the chunk's recomputed log-softmax, its incoming gradient and the
      logits gradient (three fp32 ``C x vocab``);
    * the output projection's backward: the log-softmax output and the logits gradient, the
      chunk's new weight gradient (``vocab x dim``) and its input gradient (``C x dim``).

    From the second chunk on, both moments also hold the weight gradient summed over the earlier
    chunks (``grad_bytes`` per element) and the whole ``tokens x dim`` input gradient the chunks'
    slices accumulate into."""
    rows = tokens if chunk <= 0 else min(chunk, tokens)
    logits = rows * vocab * 4
    ws = 2 * logits
    if chunk <= 0:
        return tokens * vocab * 4, ws
    multi = tokens > chunk
    summed = (vocab * dim * grad_bytes + tokens * dim * act) if multi else 0
    softmax = ws + logits + summed
    projection = ws + vocab * dim * grad_bytes + rows * dim * act + summed
    return 0, max(softmax, projection)


def _estimate_rank(
    cfg: JobConfig,
    a: ModelArgs,
    dims: ParallelDims,
    plan: PipelinePlan | None,
    pp_rank: int,
    device_type: str,
    steady_state: bool,
) -> MemoryEstimate:
    t, p = cfg.training, cfg.parallelism
    tp, cp, n_shard = dims.tp, dims.cp, dims.dp_shard * dims.cp
    fsdp = dims.fsdp_enabled
    act = param_dtype_bytes(cfg, device_type)
    mw = master_weight_bytes(cfg)  # stored parameters and their gradients
    offload = cfg.parallelism.fsdp_cpu_offload and fsdp
    shapes = _shapes(a, tp)
    notes: list[str] = []

    # What this rank holds: its stages' blocks, and the embedding / head if it has them.
    model_plan = MODELS[cfg.model.name].parallel_plan(a)
    every_unit = model_plan.unit_names
    units = (
        [u for s in plan.stage_ids(pp_rank) for u in plan.stage_units[s]] if plan else every_unit
    )
    layers = _block_ids(units, model_plan.blocks)
    has_embedding, has_head = every_unit[0] in units, every_unit[-1] in units
    tied = a.tie_word_embeddings
    root_shapes: list[tuple[int, int]] = []
    if has_embedding:
        root_shapes.append(shapes.embedding)
    if has_head:
        root_shapes += [shapes.head[0]] if tied and has_embedding else list(shapes.head)

    def stored(shape_list: list[tuple[int, int]] | tuple[tuple[int, int], ...]) -> int:
        return sum(_shard_elems(s, n_shard) if fsdp else s[0] * s[1] for s in shape_list)

    # Per block (MoE blocks: router, experts per expert parallel, shared experts; moe_memory.py)
    sizes = {
        i: moe_terms.block_sizes(
            a, shapes.block, shapes.block_linear, i, stored, dims.ep, n_shard, fsdp
        )
        for i in layers
    }
    param_elems = stored(root_shapes) + sum(b.stored for b in sizes.values())
    parameters = param_elems * mw
    moments = param_elems * optimizer_state_bytes_per_param(cfg.optimizer.moments_dtype)
    optimizer_states = moments if steady_state else 0
    grads_all = param_elems * mw
    host = 0
    if offload:  # shards, their gradients and the optimizer live on the host
        host, parameters, optimizer_states = parameters + grads_all + optimizer_states, 0, 0
        notes.append(f"CPU offload: {format_bytes(host)} in host memory")

    # Parameters in their compute form while forward/backward runs.
    f8 = cfg.quantize.dense.float8
    big = max(sizes.values(), key=lambda b: b.gathered) if sizes else None
    block_full = big.gathered if big else 0  # the largest block (MoE blocks differ)
    linear_full = big.linear_gathered if big else 0
    unsharded_block = block_full * act
    if f8.enable and f8.enable_fsdp_float8_all_gather and fsdp:
        unsharded_block = linear_full * 1 + (block_full - linear_full) * act
        notes.append("float8 all-gather: block linears gathered in float8 (1 byte)")
    unsharded_root = _full(tuple(root_shapes)) * act
    reshard = reshard_policy(p.fsdp_reshard_after_forward, dims.pp_enabled)
    needs_copy = fsdp or dims.ddp_enabled or act != mw
    if not needs_copy:
        unsharded_fwd = 0
        unsharded_block_live = 0
    elif fsdp or dims.ddp_enabled:
        blocks_live = 2 if reshard else len(layers)  # current + prefetched, or all
        unsharded_block_live = min(blocks_live, len(layers)) * unsharded_block
        unsharded_fwd = unsharded_root + unsharded_block_live
    else:  # autocast without FSDP: a low-precision copy of every weight until backward ends
        unsharded_block_live = len(layers) * unsharded_block
        unsharded_fwd = unsharded_root + unsharded_block_live
        notes.append("autocast keeps a low-precision copy of every weight during the step")

    # Tokens per microbatch on this rank, and the microbatches in flight.
    n_mb = plan.n_microbatches if plan else 1
    mb_tokens = t.local_batch_size // n_mb * t.seq_len // cp
    in_flight = in_flight_microbatches(plan, pp_rank)
    ac = cfg.activation_checkpoint
    option: int | str = (
        parse_selective_option(ac.selective_ac_option) if ac.mode == "selective" else 0
    )
    modes = {i: _checkpointed(i, ac.mode, option) for i in layers}
    per_block = {
        i: _layer_activations(a, i, mb_tokens, act, dims, modes[i], device_type) for i in layers
    }
    full_block = {
        i: _layer_activations(a, i, mb_tokens, act, dims, "none", device_type) for i in layers
    }
    vocab_local = a.vocab_size // tp
    head_saved = 0
    if has_head:
        # final norm (x, normed: sequence-sharded; output: gathered under TP) + fp32 log-softmax
        head_saved = (
            int(mb_tokens * (3 * a.dim / tp if tp == 1 else 2 * a.dim / tp + a.dim) * act)
            + norm_upcast_bytes(a, mb_tokens, act, tp, device_type)
            + loss_working_set(mb_tokens, vocab_local, act, t.loss_chunk_size)[0]
        )
    emb_saved = mb_tokens * 8 if has_embedding else 0  # token ids
    stages = len(plan.stage_ids(pp_rank)) if plan else 1
    per_mb = sum(per_block.values()) + head_saved + emb_saved
    # In-flight microbatch-stages hold on average 1/stages of this rank's activations each.
    activations_all = per_mb * in_flight // stages if plan else per_mb

    # Pipeline receive buffers: one activation and one gradient buffer per microbatch.
    pipeline_buffers = 0
    if plan is not None:
        residual = mb_tokens * a.dim // tp * act
        first = 0 in plan.stage_ids(pp_rank)
        last = plan.num_stages - 1 in plan.stage_ids(pp_rank)
        n_recv = (stages - (1 if first else 0)) + (stages - (1 if last else 0))
        pipeline_buffers = n_mb * residual * n_recv

    accum = dims.batch_plan(t.local_batch_size, t.global_batch_size).grad_accum_steps
    # Gradients of earlier microbatches stay through later ones: gradient accumulation, and the
    # pipeline's steady state (a backward, then more in-flight forwards). Under PP, torch's
    # stages run every backward without FSDP's gradient sync: the gradients accumulate
    # unsharded (in the reduce dtype) and the parameters stay gathered until the step's end.
    steady = plan is not None and n_mb * stages > in_flight
    reduce_bytes = resolve_dtype(t.mixed_precision_reduce, device_type).itemsize if act != 4 else 4
    pp_fsdp = plan is not None and fsdp
    unsharded_grads = (
        _full(tuple(root_shapes)) + sum(b.gathered for b in sizes.values())
    ) * reduce_bytes
    device_grads = 0 if offload else grads_all  # offloaded gradient shards go to the host
    carried_grads = device_grads if accum > 1 else 0
    if steady:
        carried_grads = unsharded_grads if pp_fsdp else device_grads

    # --- moment 1: loss backward (head rank only has logits)
    head_grad = act if fsdp else mw  # the output weight's gradient in the chunked loss
    loss_ws = (
        loss_working_set(mb_tokens, vocab_local, act, t.loss_chunk_size, a.dim, head_grad)[1]
        if has_head
        else 0
    )
    out_grad = 0
    if has_head and (fsdp or act != mw):
        out_grad = _full(tuple(root_shapes)) * act
    elif has_head and not offload:  # the head's .grad, written by the loss backward
        out_grad = _full(shapes.head) * mw
    candidates: list[tuple[int, str, int, int, int, int]] = []
    # (total, phase, activations, working_set, gradients, unsharded)
    # Blocks resharded after forward hold nothing here; the root unit (embedding, head) does.
    unsharded_loss = unsharded_root if (fsdp or dims.ddp_enabled) and reshard else unsharded_fwd
    if not needs_copy:
        unsharded_loss = 0
    candidates.append(
        (
            activations_all + loss_ws + unsharded_loss + carried_grads,
            "loss backward",
            activations_all,
            loss_ws,
            carried_grads,
            unsharded_loss,
        )
    )
    # --- moment 2: each block's backward, last to first (the last in-flight microbatch)
    done_grads = 0
    below = activations_all - (per_mb - emb_saved) // max(stages, 1) if plan else emb_saved
    below_blocks = sorted(layers)
    root_grad = 0 if pp_fsdp and steady else out_grad  # else already in the carried gradients

    def own_grads(gathered: int, stored: int) -> int:
        """A block's own gradients: unsharded in the compute dtype before FSDP's
        reduce-scatter, else straight into .grad."""
        if pp_fsdp:
            return 0 if steady else gathered * reduce_bytes
        return gathered * act if (fsdp or act != mw) else stored * mw

    for idx in range(len(below_blocks) - 1, -1, -1):
        i = below_blocks[idx]
        lower = sum(per_block[j] for j in below_blocks[:idx])
        recompute = full_block[i] if modes[i] != "none" else per_block[i]
        own = own_grads(sizes[i].gathered, sizes[i].stored)
        if not (fsdp or act != mw):
            # Without FSDP each weight gradient lands in .grad as its op's backward runs: at the
            # block's peak (the SwiGLU backward) only the down projection's exists (planning.md).
            own = min(own, _full(shapes.block[5:6]) * mw)
        ws = block_backward_bytes(a, mb_tokens, act, tp) + own
        experts = own_grads(sizes[i].experts_gathered, sizes[i].experts_stored)
        ws += moe_terms.moe_backward_delta(a, i, mb_tokens, act, tp, experts)
        grads = max(carried_grads, done_grads) + root_grad
        live = below + lower + recompute
        unsharded = (
            unsharded_root + min(2, len(layers)) * unsharded_block
            if fsdp and reshard
            else unsharded_fwd
        )
        candidates.append(
            (
                live + ws + grads + unsharded,
                f"block backward (layer {i})",
                live,
                ws,
                grads,
                unsharded,
            )
        )
        if pp_fsdp:
            done_grads += sizes[i].gathered * reduce_bytes
        elif not offload:
            done_grads += sizes[i].stored * mw
    # --- the embedding's backward: its whole gradient (its vocabulary rows under TP) is made
    # next to every gradient accumulated so far.
    if has_embedding:
        new = shapes.embedding[0] * shapes.embedding[1] * (act if (fsdp or act != mw) else mw)
        grads = max(carried_grads, done_grads) + root_grad
        unsharded = unsharded_root if fsdp and reshard else unsharded_fwd
        if not needs_copy:
            unsharded = 0
        candidates.append(
            (below + new + grads + unsharded, "embedding backward", below, new, grads, unsharded)
        )
    # --- moment 3: the optimizer step
    candidates.append((device_grads, "optimizer step", 0, 0, device_grads, 0))
    total, phase, acts, ws, grads, unsharded = max(candidates, key=lambda c: c[0])
    return MemoryEstimate(
        parameters=parameters,
        gradients=grads,
        optimizer_states=optimizer_states,
        activations=acts,
        unsharded_parameters=unsharded,
        working_set=ws,
        pipeline_buffers=pipeline_buffers,
        temporaries=0,
        phase=phase,
        pp_rank=pp_rank,
        in_flight_microbatches=in_flight,
        per_microbatch_activations=per_mb,
        notes=notes,
        host=host,
    )
