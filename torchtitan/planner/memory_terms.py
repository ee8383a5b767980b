"""The formulas of the memory estimate (docs/planning.md) and its result type: parameter shapes
of a stage, the bytes autograd saves per block, the gradient working sets, the loss's working
set and the bytes per element of each state. Pure arithmetic on a ``DecoderShape``; ``rank_memory.py`` combines them
into one rank's step, ``estimator.py`` is the entry point."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.activation_checkpoint import parse_selective_option
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.pipeline_stages import SCHEDULES, PipelineStages
from torchtitan.distributed.utils import resolve_dtype
from torchtitan.models.common.vision.args import VisionArgs
from torchtitan.models.common.vision.memory import (
    tower_backward_bytes,
    tower_block_saved_bytes,
    tower_saved_bytes,
    tower_shapes,
)
from torchtitan.models.spec import DecoderShape as ModelArgs
from torchtitan.planner import moe_memory as moe_terms

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
class Shapes:
    """Parameter tensors of a stage, as (dim0, dim1) after tensor parallel."""

    block: tuple[tuple[int, int], ...]
    block_linear: tuple[bool, ...]
    embedding: tuple[int, int]
    head: tuple[tuple[int, int], ...]


def is_mla(a: Any) -> bool:
    """Whether the model's attention is multi-head latent attention (DeepSeek-V3)."""
    return hasattr(a, "kv_lora_rank")


def attention_shapes(a: Any, tp: int) -> list[tuple[tuple[int, int], bool]]:
    """The attention's parameters after TP, each with whether it is a matmul weight: wq, wk,
    wv, wo; under MLA the query latent (``wq_a``, ``q_norm``, ``wq_b``; or ``wq``), the
    key/value latent (``wkv_a``, ``kv_norm``, ``wkv_b``) and ``wo``, the up-projections and
    ``wo`` split by heads, the down-projections and latent norms replicated."""
    d, hd = a.dim, a.head_dim
    if not is_mla(a):
        q, kv = a.n_heads * hd // tp, a.kv_heads * hd // tp
        return [((q, d), True), ((kv, d), True), ((kv, d), True), ((d, q), True)]
    h, ql, r = a.n_heads, a.q_lora_rank, a.kv_lora_rank
    query = [((h * hd // tp, d), True)]
    if ql:
        query = [((ql, d), True), ((ql, 1), False), ((h * hd // tp, ql), True)]
    kv = [((r + a.qk_rope_head_dim, d), True), ((r, 1), False)]
    kv.append(((h * (a.qk_nope_head_dim + a.v_head_dim) // tp, r), True))
    return [*query, *kv, ((d, h * a.v_head_dim // tp), True)]


def stage_shapes(a: ModelArgs, tp: int) -> Shapes:
    """A block is its attention (``attention_shapes``), the three SwiGLU matrices and the two
    norms, in that order (the last five entries are always the SwiGLU's and the norms')."""
    d, hid = a.dim, a.hidden_dim
    attention = attention_shapes(a, tp)
    ffn = [(hid // tp, d), (d, hid // tp), (hid // tp, d)]
    block = tuple([s for s, _ in attention] + ffn + [(d, 1), (d, 1)])  # + the two RMSNorms
    return Shapes(
        block=block,
        block_linear=tuple(lin for _, lin in attention) + (True,) * 3 + (False, False),
        embedding=(a.vocab_size // tp, d),
        head=((d, 1), (a.vocab_size // tp, d)),
    )


def block_params(a: ModelArgs) -> int:
    """Parameters of one block (the planner weighs compute and pipeline stages with it); the
    mean block of a model whose blocks differ (``mixer_shapes``)."""
    shapes = stage_shapes(a, 1)
    if not callable(getattr(a, "mixer_shapes", None)):
        return total_elems(shapes.block)
    per_layer = [total_elems(layer_shapes(a, i, 1, shapes)[0]) for i in range(a.n_layers)]
    return sum(per_layer) // max(len(per_layer), 1)


def layer_shapes(
    a: Any, layer: int, tp: int, shapes: Shapes
) -> tuple[tuple[tuple[int, int], ...], tuple[bool, ...]]:
    """Block ``layer``'s parameter shapes after TP and which are matmul weights: the uniform
    ``shapes.block``, or, for a model whose layers mix token mixers (Qwen3.5's DeltaNet and
    attention), its ``mixer_shapes(layer, tp)`` followed by the SwiGLU's and the norms'."""
    mixer = getattr(a, "mixer_shapes", None)
    if not callable(mixer):
        return shapes.block, shapes.block_linear
    own = mixer(layer, tp)
    block = tuple(s for s, _ in own) + shapes.block[-5:]
    return block, tuple(lin for _, lin in own) + shapes.block_linear[-5:]


def shard_elems(shape: tuple[int, int], n: int) -> int:
    """FSDP2 shards dim 0 over ``n`` ranks, padding it to a multiple of ``n``."""
    return math.ceil(shape[0] / n) * shape[1]


def total_elems(shapes: tuple[tuple[int, int], ...]) -> int:
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


def mla_activation_bytes(
    a: Any, tokens: int, act: int, tp: int, cp: int, mode: str, device_type: str
) -> int:
    """Bytes autograd saves for one MLA block (``models/deepseek_v3/mla.py``) with the dense
    SwiGLU (an MoE block adds ``moe_activation_delta``), over ``tokens`` local tokens.

    Per token, ``none`` (counted from ``saved_tensors_hooks`` on the debug flavor's block,
    ``tests/unit/test_estimator.py``): the two norms as in the dense formula (``3 d`` each;
    under TP the attention norm's output stays sequence-sharded, the down-projections take
    it); the query latent ``wq_a`` output, normalized and norm output (``3 q_lora``; the last
    all-gathered under TP) and the key/value latent ``wkv_a`` output (``kv_lora + rope``, the
    compressed latent and the decoupled RoPE key), normalized and norm output (``2 kv_lora``);
    the up-projected per-head ``q`` and ``k`` (``H (nope + rope)`` each, ``k`` whole-sequence
    under CP), ``v`` (``H v``, padded to the key width under CP) and the attention output that
    enters ``wo`` (``H v``); fp32: the four RMS statistics and the attention's log-sum-exp
    (``H``) on CUDA. On CPU the query and value widths differ, so SDPA takes its math path and
    saves the softmax probabilities (``H x seq_len`` values per token) instead.
    ``full``: the block input. ``op``: the block input, the outputs of every second matmul
    (``wq_a``, ``wkv_a``, ``wo``, the SwiGLU's ``w3``) and the attention output (estimated)."""
    d, hid, h = a.dim, a.hidden_dim, a.n_heads
    ql, r, rope = a.q_lora_rank, a.kv_lora_rank, a.qk_rope_head_dim
    qk, v = a.head_dim, a.v_head_dim
    if mode == "full":
        return int(tokens * d / tp * act)
    if mode == "op":
        elems = d / tp + (ql + r + rope + h * v + d + hid) / tp
        return int(tokens * (elems * act + h / tp * 4))
    # Sequence-sharded tensors are / tp; the up-projections' and w1/w3's inputs are
    # all-gathered (whole width on every TP rank).
    norms = 5 * d / tp + d
    query = 2 * ql / tp + ql if ql else 0
    latent = (r + rope) / tp + r / tp + r
    kv_width = v if cp == 1 else qk
    core = (h * qk + h * qk * cp + h * kv_width * cp + h * v) / tp
    stats = (3 + (1 if ql else 0)) / tp
    if device_type == "cpu" and cp == 1:
        core += h / tp * a.max_seq_len
    else:
        stats += h / tp
    ffn = 4 * hid / tp
    return int(tokens * ((norms + query + latent + core + ffn) * act + stats * 4))


def mtp_root_shapes(a: Any, depth: int) -> list[tuple[int, int]]:
    """The MTP modules' weights outside their blocks (DeepSeek-V3, ``mtp.py``): ``enorm``,
    ``hnorm``, the final ``norm`` and the ``2 dim -> dim`` projection (replicated under TP)."""
    return [(a.dim, 1)] * 3 * depth + [(a.dim, 2 * a.dim)] * depth


def mtp_saved_bytes(a: Any, tokens: int, act: int, tp: int, depth: int) -> int:
    """What the MTP modules save besides their blocks (``layer_activations`` of block
    ``n_layers + k``), per token and depth: the shifted tokens' embedding and its normalized
    copy, the normalized hidden state, the ``2 dim`` concatenation ``eh_proj`` reads, the
    module's output and its final norm's normalized input and output (``8 dim``), three fp32
    RMS statistics, the fp32 log-softmax over the (local) vocabulary and the embedded ids;
    once, the ``[B, S, depth + 1]`` int64 shifted tokens (measured with
    ``saved_tensors_hooks``: ``tests/unit/test_deepseek_v3_estimator.py``)."""
    per_depth = 8 * a.dim / tp * act + 3 * 4 + a.vocab_size // tp * 4 + 8
    return int(tokens * (depth * per_depth + (depth + 1) * 8))


def mla_note(a: Any, per_block: dict[int, int], tokens: int) -> str:
    """explain's MLA line: saved bytes per token of a block, and the generation KV cache per
    token (the latent and the rotated key per layer) next to per-head K/V's."""
    layer, first = next(iter(per_block.items()), (0, 0))
    cache = a.kv_cache_bytes_per_token(2)
    per_head = 2 * a.n_heads * a.head_dim * 2 * a.n_layers
    return (
        f"MLA: block {layer} saves {first / max(tokens, 1):,.0f} bytes per token (latents, rotated "
        f"key, per-head q/k/v); KV cache {cache:,} bytes per token in bf16 (kv_lora_rank + "
        f"qk_rope_head_dim per layer), per-head K/V would be {per_head:,}"
    )


def norm_upcast_bytes(a: ModelArgs, tokens: int, act_bytes: int, tp: int, device_type: str) -> int:
    """Extra bytes one saved RMSNorm costs on CPU with a low-precision input: torch's composite
    (unfused) RMSNorm there saves its input and normalized input upcast to fp32, 4 bytes per
    element more than the compute-dtype copies the formulas count (measured with
    ``saved_tensors_hooks``; CUDA's fused kernel saves the input and the fp32 statistics only)."""
    if device_type != "cpu" or act_bytes >= 4:
        return 0
    return int(tokens * a.dim / tp * 4)


def layer_activations(
    a: ModelArgs,
    layer: int,
    tokens: int,
    act_bytes: int,
    dims: ParallelDims,
    mode: str,
    device_type: str,
) -> int:
    """Saved bytes of block ``layer``: the dense formula (MLA's own under MLA), plus QK-norm's tensors and an MoE
    feed-forward in place of the SwiGLU where the model has them (``moe_memory.py``), plus the
    two norms' fp32 copies on CPU in low precision (recomputed under full and op-level AC)."""
    upcast = 2 * norm_upcast_bytes(a, tokens, act_bytes, dims.tp, device_type)
    own = getattr(a, "block_saved_bytes", None)
    if callable(own):  # a family whose blocks differ says what each saves (Qwen3.5)
        base = own(layer, tokens, act_bytes, dims.tp, mode)
    elif is_mla(a):
        base = mla_activation_bytes(a, tokens, act_bytes, dims.tp, dims.cp, mode, device_type)
    else:
        base = block_activation_bytes(a, tokens, act_bytes, dims.tp, dims.cp, mode)
    return (
        base
        + (upcast if mode == "none" else 0)
        + moe_terms.qk_norm_activation_bytes(a, tokens, act_bytes, dims.tp, mode)
        + moe_terms.moe_activation_delta(a, layer, tokens, act_bytes, dims.tp, mode, dims.ep)
    )


def block_backward_bytes(a: ModelArgs, tokens: int, act_bytes: int, tp: int) -> int:
    """Gradient working set while one block runs backward: the incoming gradient and the
    gradient of its input (at full sequence length under tensor parallel, where the sequence-
    parallel all-gathers turn into reduce-scatters), and two SwiGLU-wide gradients."""
    return int(tokens * (2 * a.dim + 2 * a.hidden_dim / tp) * act_bytes)


def block_ids(units: list[str], blocks: str) -> list[int]:
    return [int(u.rpartition(".")[2]) for u in units if u.startswith(f"{blocks}.")]


def checkpoint_mode(layer: int, mode: str, option: int | str) -> str:
    """AC treatment of a block: 'none', 'full' or 'op'."""
    if mode == "full":
        return "full"
    if mode == "selective":
        if option == "op":
            return "op"
        assert isinstance(option, int)
        return "full" if (layer + 1) % option == 0 else "none"
    return "none"


def in_flight_microbatches(plan: PipelineStages | None, pp_rank: int) -> int:
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


def optimizer_state_bytes_per_param(moments_dtype: str) -> int:
    """Bytes of AdamW/Adam state per parameter element: two moments (docs/memory.md)."""
    return 2 * (2 if moments_dtype == "bfloat16" else 4)


MUON_BUFFER_BYTES = 4  # one fp32 momentum buffer per element of a Muon matrix (docs/optimizers.md)


def muon_step_bytes(
    block: tuple[tuple[int, int], ...], linear: tuple[bool, ...], n_layers: int, stored: Any,
    ns_bytes: int,
) -> int:  # fmt: skip
    """Muon's transient bytes at the optimizer step: the largest bucket of same-shaped block
    matrices (one per shape and layer), held three times in ``ns_bytes`` (the stacked shards,
    the whole matrices a rank receives, the Newton-Schulz iterate) (``optim/muon_dist.py``)."""
    counts: dict[tuple[int, int], int] = {}
    for shape, is_linear in zip(block, linear):
        if is_linear:
            counts[shape] = counts.get(shape, 0) + 1
    if not counts:
        return 0
    largest = max(stored([shape]) * c for shape, c in counts.items())
    return 3 * largest * n_layers * ns_bytes


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


# ---------------------------------------------------------------------- a vision tower
@dataclass(frozen=True)
class TowerMemory:
    """The tower's share of one pipeline rank's memory (elements, or bytes where named)."""

    shapes: list[tuple[int, int]]
    """Every parameter of the tower, as FSDP shards them."""
    largest_unit: int
    """Elements of its largest FSDP unit (gathered while it runs)."""
    saved_bytes: int
    """Saved by autograd per microbatch."""
    backward_bytes: int
    """One block's backward working set."""
    patches: int
    """Patches per microbatch."""


def tower_memory(a: Any, cfg: Any, samples: int, act: int, device_type: str) -> TowerMemory | None:
    """The vision tower of ``a`` (None without one) on the rank holding it (the first pipeline
    stage), for microbatches of ``samples`` samples of ``training.image_tokens_per_sample``
    merged image tokens (one image each), ``act``-byte activations
    (``models/common/vision/memory.py``). Not divided by ``cp`` (every cp rank encodes the whole
    batch's images) nor ``tp`` (replicated); AC wraps its blocks as the decoder's."""
    v: VisionArgs | None = getattr(a, "vision", None)
    if v is None:
        return None
    per_image = cfg.training.image_tokens_per_sample * v.spatial_merge_size**2
    patches = samples * per_image
    root, blocks = tower_shapes(v)
    units = [root, *blocks]
    ac = cfg.activation_checkpoint
    option: int | str = (
        parse_selective_option(ac.selective_ac_option) if ac.mode == "selective" else 0
    )
    wrapped = sum(checkpoint_mode(i, ac.mode, option) == "full" for i in range(v.depth))
    backward = tower_backward_bytes(v, patches, per_image, act, device_type == "cpu")
    if wrapped:  # a wrapped block's backward first recomputes what it did not save
        backward += patches * tower_block_saved_bytes(v, per_image, act, device_type)
    return TowerMemory(
        shapes=[s for unit in units for s in unit],
        largest_unit=max(sum(r * c for r, c in unit) for unit in units),
        saved_bytes=tower_saved_bytes(v, patches, per_image, act, device_type, wrapped),
        backward_bytes=backward,
        patches=patches,
    )
