"""The job configuration: one dataclass per TOML section, a docstring on every field.

The attribute docstrings are read by ``torchtitan.config.manager`` and become ``--help`` and
``docs/config.md``; keep each one a sentence or two that says what the field does and its units.
Cross-field rules live in ``torchtitan.preflight.validate``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class Job:
    config_file: str | None = None
    """TOML file this job was loaded from (set by ``--job.config_file``)."""

    dump_folder: str = "./outputs"
    """Folder for everything a run writes: metrics, TensorBoard, checkpoints, traces."""

    description: str = "torchtitan job"
    """Free-text description, shown in the first log lines and in W&B."""

    print_config: bool = False
    """Log the fully resolved config (TOML) at start-up."""

    explain: bool = False
    """Print the preflight plan (mesh axes, per-rank batch and tokens, gradient accumulation, pipeline stages and bubble, memory estimate, warnings) and exit without training; needs no process group."""


@dataclass
class Model:
    name: str = "llama3"
    """Model family; a key of ``torchtitan.models.MODELS``."""

    flavor: str = "debugmodel"
    """Size of the model within its family (llama3: debugmodel, 1B, 8B, 70B, 405B)."""

    tokenizer_path: str = "tests/assets/tokenizer"
    """tiktoken BPE ranks file, or a folder holding ``tokenizer.model``."""

    attn_mask_type: Literal["causal", "block_causal"] = "causal"
    """Attention mask of packed training windows: causal (every token sees all earlier tokens of the window, including the previous documents) or block_causal (only earlier tokens of its own document; batches then carry document ids, see docs/attention.md)."""

    attn_backend: Literal["auto", "sdpa", "flex"] = "auto"
    """Kernel for block_causal attention: sdpa (a dense boolean mask, exact, any device), flex (FlexAttention with a block mask built once per batch; CUDA, skips blocks between documents) or auto (flex on CUDA without context parallel, else sdpa). Causal attention always uses SDPA."""

    moe_aux_loss_coef: float = -1.0
    """MoE flavors: coefficient of the load-balancing auxiliary loss (0 turns it off); -1 keeps the flavor's (docs/moe.md)."""

    moe_bias_update_rate: float = -1.0
    """MoE flavors: step of the auxiliary-loss-free routing bias per optimizer step (0 turns it off); -1 keeps the flavor's."""


@dataclass
class MixtureSource:
    path: str = ""
    """A corpus folder written by scripts/pretokenize.py (it holds manifest.json), or local text files (a JSONL/parquet/text file or folder)."""

    dataset: str = ""
    """A text dataset name as training.dataset (registered or hub), with path as its dataset_path; empty with a corpus folder."""

    weight: float = 1.0
    """Relative share of this source's windows in the mixture (> 0; weights are normalised)."""


@dataclass
class Training:
    dataset: str = "test_corpus"
    """Dataset name: ``test_corpus`` (shipped), ``json``/``parquet``/``text`` with dataset_path, a hub name, ``tokenized`` (dataset_path is a corpus folder of scripts/pretokenize.py) or ``mixture`` (training.mixture)."""

    dataset_path: str | None = None
    """Local file or folder for the dataset; overrides the registered default path."""

    data_sharding: Literal["window", "document"] = "window"
    """How data-parallel ranks share the data: window (rank r keeps packed windows r, r+dp, ...; identical data at any dp degree, every rank tokenizes everything) or document (documents split among ranks; scales to large dp, data depends on the dp degree)."""

    local_batch_size: int = 8
    """Sequences per data-parallel rank per micro-step."""

    global_batch_size: int = -1
    """Sequences per optimizer step over all data-parallel ranks; -1 means local_batch_size x dp degree. A multiple of that product turns on gradient accumulation."""

    seq_len: int = 2048
    """Tokens per training sequence."""

    document_positions: bool = False
    """With model.attn_mask_type = block_causal, restart the RoPE positions at 0 at each document start, as if each document were alone in its window. Default false (positions count from the window start, as in TorchTitan): RoPE scores depend only on the distance between two tokens of the same document, so under block_causal both give the same attention up to rounding of the rotation angles."""

    max_norm: float = 1.0
    """Clip the total gradient norm to this value; 0 or less disables clipping (the norm is still reported)."""

    steps: int = 10000
    """Number of optimizer steps to train for."""

    mixed_precision_param: Literal["auto", "bfloat16", "float32"] = "auto"
    """Compute dtype of parameters in forward/backward (master weights stay fp32). auto: bfloat16 on CUDA, float32 on CPU."""

    mixed_precision_reduce: Literal["float32", "bfloat16"] = "float32"
    """dtype of gradient reduce-scatter/all-reduce under FSDP."""

    gc_freq: int = 50
    """Run Python's garbage collector every this many steps (automatic GC is disabled during training); 0 keeps automatic GC."""

    nonfinite_policy: Literal["raise", "skip_step"] = "raise"
    """What a NaN/inf loss or gradient norm does (it is reported with the step, the rank and the first parameter with a non-finite gradient): raise stops training; skip_step skips that optimizer step (the LR schedule still advances) and counts it."""

    tokenized_shuffle: Literal["none", "windows", "documents"] = "none"
    """Order of the windows of pre-tokenized data (dataset = "tokenized" and tokenized mixture sources): none (the corpus in order, as the text path), windows (a seeded permutation of each epoch's windows) or documents (documents in a seeded order, new each epoch, then cut into windows); seeded by debug.seed. See docs/data.md."""

    mixture: list[MixtureSource] = field(default_factory=list)
    """With dataset = "mixture": the sources, as [[training.mixture]] tables of path / dataset / weight (TOML only); windows are interleaved deterministically by weight. See docs/data.md."""

    mixture_exhausted: Literal["wrap", "error"] = "wrap"
    """What a mixture source that has given all its windows does: wrap (starts its next epoch, logged) or error (training stops with an error naming the source)."""

    spike_policy: Literal["off", "warn", "skip_step", "rollback"] = "off"
    """What a loss spike (robust z-score of the step's loss against the last spike_window losses above spike_threshold) does: warn logs it; skip_step skips that optimizer step; rollback reloads the newest checkpoint before the step and skips the step's batches (needs checkpoint.enable). Costs one small all-reduce per step when on."""

    spike_window: int = 50
    """Number of recent accepted losses the spike detector compares each step's loss with (median and MAD)."""

    spike_threshold: float = 6.0
    """Robust z-score above which a step's loss is a spike: (loss - median) / (1.4826 x MAD)."""

    spike_warmup: int = 20
    """Steps whose losses are only collected, never scored (the loss falls fast early in training)."""

    max_consecutive_skips: int = 10
    """Abort training after this many consecutive skipped steps (spike_policy or nonfinite_policy skip_step), or this many rollbacks for the same step; 0 never aborts. A skipped step whose weights are non-finite always aborts."""

    loss_chunk_size: int = 0
    """Chunked linear + cross-entropy: compute the output projection and the loss this many tokens at a time (each chunk recomputed in backward), so the full [tokens, vocab] logits never exist; 0 computes the logits whole. Same loss and gradients (docs/memory.md)."""


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = 1
    """Replicas of the model (DDP, or the replicate axis of HSDP)."""

    data_parallel_shard_degree: int = -1
    """FSDP shard degree; -1 uses every rank left after the other degrees."""

    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """Free gathered parameters after forward: always (less memory), never (less communication), default (always, except never under pipeline parallel)."""

    tensor_parallel_degree: int = 1
    """Tensor parallel degree (Megatron-style column/row sharding with sequence parallel)."""

    disable_loss_parallel: bool = False
    """With tensor parallel, gather the logits before the loss instead of computing it on sharded logits."""

    enable_async_tensor_parallel: bool = False
    """Overlap TP communication with compute (CUDA only; needs compile.enable)."""

    pipeline_parallel_degree: int = 1
    """Number of pipeline ranks."""

    pipeline_parallel_schedule: str = "1F1B"
    """Pipeline schedule (GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV); case-insensitive."""

    pipeline_parallel_microbatches: int = -1
    """Microbatches each local batch is split into per pipeline step (at least the number of stages, dividing training.local_batch_size); -1 uses the number of pipeline stages."""

    pipeline_parallel_microbatch_size: int = -1
    """Sequences per pipeline microbatch, instead of pipeline_parallel_microbatches (local_batch_size / this microbatches); -1 leaves it to pipeline_parallel_microbatches."""

    pipeline_parallel_split_points: list[str] = field(default_factory=list)
    """Layer names where a new pipeline stage starts, e.g. layers.4,layers.8 (norm gives the final norm + output a stage of their own); empty splits evenly."""

    pipeline_parallel_layers_per_stage: int = -1
    """Layers per pipeline stage when splitting evenly, the embedding and the final norm + output counting as one layer each; -1 uses one stage per rank (two for multi-stage schedules)."""

    context_parallel_degree: int = 1
    """Context parallel degree: every sequence is split over this many ranks (head-tail load balanced; seq_len must be divisible by 2 x this)."""

    context_parallel_method: Literal["allgather", "ring"] = "allgather"
    """How attention sees the whole sequence under context parallel: allgather (K/V all-gathered over cp, exact, any device) or ring (torch's experimental ring attention, CUDA only)."""

    context_parallel_rotate_method: Literal["allgather", "alltoall"] = "allgather"
    """For context_parallel_method ring: how torch rotates the K/V shards between cp ranks."""

    expert_parallel_degree: int = 1
    """Expert parallel degree (MoE models): the routed experts are split over this many ranks, borrowed from data_parallel_shard_degree (which it must divide); tokens reach their experts by all-to-all. Experts are FSDP-sharded over the remaining dp_shard / ep ranks (docs/parallelisms.md)."""

    fsdp_cpu_offload: bool = False
    """FSDP2 CPU offload (CPUOffloadPolicy): parameter shards, gradients and optimizer state live in host memory and the optimizer step runs on the CPU; needs FSDP (data_parallel_shard_degree > 1, with or without HSDP, TP, PP); the offload slows each step by the host-device copies (docs/memory.md)."""


@dataclass
class Optimizer:
    name: Literal["AdamW", "Adam"] = "AdamW"
    """Optimizer class from torch.optim."""

    lr: float = 8e-4
    """Peak learning rate (reached at the end of warm-up)."""

    beta1: float = 0.9
    """Adam beta1."""

    beta2: float = 0.95
    """Adam beta2."""

    eps: float = 1e-8
    """Adam epsilon."""

    weight_decay: float = 0.1
    """Decoupled weight decay (AdamW) or L2 penalty (Adam)."""

    implementation: Literal["fused", "foreach", "for-loop"] = "fused"
    """Kernel choice: fused (one kernel; falls back to foreach where the device or parameter types cannot), foreach, or a plain for-loop."""

    moments_dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype the two Adam moments are stored in: bfloat16 halves the optimizer state (the update is computed in fp32 and the moments stored with stochastic rounding; a plain-PyTorch loop instead of fused kernels; docs/memory.md)."""

    master_weights_dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype of the trained parameters themselves (and their gradients): bfloat16 halves them, with the optimizer updating in fp32 and storing with stochastic rounding; forward/backward then run in bfloat16 (docs/memory.md)."""


@dataclass
class LRScheduler:
    warmup_steps: int = 200
    """Linear warm-up steps from lr x warmup_start_factor to lr."""

    warmup_start_factor: float = 0.0
    """Fraction of lr at step 1 of warm-up (the first step uses lr x (start + (1 - start)/ (warmup_steps + 1)))."""

    decay_ratio: float = 1.0
    """Fraction of the post-warm-up steps spent decaying; below 1.0 gives warmup-stable-decay (WSD)."""

    decay_type: Literal["linear", "cosine", "sqrt"] = "linear"
    """Shape of the decay from lr to lr x min_lr_factor."""

    min_lr_factor: float = 0.0
    """Final learning rate as a fraction of lr."""


@dataclass
class Checkpoint:
    enable: bool = False
    """Save and resume distributed (DCP) checkpoints."""

    folder: str = "checkpoint"
    """Checkpoint folder, relative to job.dump_folder."""

    interval: int = 500
    """Save every this many steps."""

    keep_latest_k: int = 10
    """Keep this many newest checkpoints; 0 keeps all."""

    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
    """Save in the background: async (a thread with its own process group) or async_with_pinned_mem (GPU)."""

    load_step: int = -1
    """Resume from exactly this step's checkpoint (an error if it is missing or corrupt); -1 resumes from the newest valid one."""

    verify_checksums: bool = True
    """Check every file's SHA-256 against the manifest before loading (reads the checkpoint once more); sizes are always checked."""

    exclude_from_loading: list[str] = field(default_factory=list)
    """Parts of a checkpoint not to load: any of model, optimizer, lr_scheduler, dataloader, train_state (then training restarts at step 0), rng."""

    initial_load_path: str = ""
    """When the checkpoint folder holds no checkpoint yet, load initial weights from this step-N folder (e.g. made by scripts/convert_from_hf.py), or from a Hugging Face folder with initial_load_in_hf; empty starts from random weights."""

    initial_load_model_only: bool = True
    """From initial_load_path, load only the model weights (training starts at step 0); false loads everything it holds, except exclude_from_loading."""

    initial_load_in_hf: bool = False
    """initial_load_path is a Hugging Face folder (config.json + *.safetensors) whose weights are converted on load (llama3)."""

    create_seed_checkpoint: bool = False
    """Build and initialize the model, save it as a model-only step-0 checkpoint in the checkpoint folder and exit without training; one process with every parallel degree 1. Later runs at any parallelism start from these weights."""

    last_save_model_only: bool = False
    """The checkpoint of the last training step holds only the model weights, cast to export_dtype (for shipping or scripts/convert_to_hf.py); interval checkpoints stay complete, and resume skips this one."""

    export_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Data type of the weights in the last_save_model_only checkpoint."""


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "full", "selective"] = "none"
    """Recompute activations in backward: none, full (every block) or selective."""

    selective_ac_option: str = "2"
    """For selective mode: an integer N checkpoints every Nth block (layer ids N-1, 2N-1, ...); 'op' checkpoints every block but saves attention and every second matmul output, recomputing the cheap ops."""


@dataclass
class Compile:
    enable: bool = False
    """torch.compile each transformer block (fullgraph) and the loss."""

    components: list[str] = field(default_factory=lambda: ["model", "loss"])
    """What compile.enable compiles: model (each transformer block) and/or loss."""

    backend: Literal["inductor", "aot_eager", "eager"] = "inductor"
    """torch.compile backend: inductor generates kernels; aot_eager and eager are for debugging."""

    cache_dir: str = ""
    """Folder for inductor's compile caches, reused by later runs (sets TORCHINDUCTOR_CACHE_DIR); a relative path is under job.dump_folder; empty keeps $TORCHINDUCTOR_CACHE_DIR or inductor's default /tmp/torchinductor_<user>."""


@dataclass
class Float8:
    enable: bool = False
    """Train eligible linear layers in float8 through torchao."""

    recipe_name: Literal["tensorwise", "rowwise"] = "tensorwise"
    """torchao float8 scaling recipe."""

    filter_fqns: list[str] = field(default_factory=lambda: ["output"])
    """Linear layers whose name contains any of these strings stay in high precision."""

    enable_fsdp_float8_all_gather: bool = False
    """All-gather FSDP parameters in float8 (tensorwise recipe only)."""

    precompute_float8_dynamic_scale_for_fsdp: bool = False
    """Compute all float8 weight scales in one all-reduce after the optimizer step (tensorwise + float8 all-gather)."""

    auto_filter_small_kn: bool = True
    """Also keep in high precision the linears too small for float8 to gain (torchao's per-recipe size thresholds, measured on H100); turn off to convert every eligible layer (small models, CPU tests)."""

    emulate: bool = False
    """Emulate the float8 matmuls in high precision (same rounding, no speed-up): for checking numerics on GPUs without float8 matmuls; always on for CPU, where torch's float8 matmul is a slow reference kernel."""


@dataclass
class DenseQuantize:
    float8: Float8 = field(default_factory=Float8)
    """Float8 training of dense linear layers."""


@dataclass
class Quantize:
    dense: DenseQuantize = field(default_factory=DenseQuantize)
    """Quantized training of dense layers."""


@dataclass
class Metrics:
    log_freq: int = 10
    """Log metrics every this many steps (and at the last step)."""

    enable_tensorboard: bool = False
    """Write scalars to TensorBoard under job.dump_folder/save_tb_folder."""

    save_tb_folder: str = "tb"
    """TensorBoard folder, relative to job.dump_folder."""

    enable_wandb: bool = False
    """Log scalars to Weights & Biases (offline unless WANDB_API_KEY is set)."""

    enable_jsonl: bool = True
    """Write one JSON object per log step to job.dump_folder/metrics/rank_<r>.jsonl."""

    save_for_all_ranks: bool = False
    """Every rank writes its own TensorBoard/W&B/JSONL metrics (default: one rank, the one holding the loss)."""

    memory_warmup_steps: int = 3
    """First steps of a run whose memory growth is expected (allocator warm-up, optimizer state): labelled warm-up in the log and not checked for leaks."""

    memory_leak_window: int = 20
    """Steps after warm-up over which the leak detector fits a memory trend (at least 8); 0 turns the detector off."""

    memory_leak_min_growth_mib: float = 16.0
    """Smallest steady growth over one leak window, in MiB, of the memory the detector watches (CUDA: allocated; CPU: C heap in use), reported as a leak; smaller trends count as noise."""

    enable_memory_trace: bool = True
    """Every rank writes each step's current and peak memory to job.dump_folder/memory/rank_<r>.jsonl."""

    enable_cross_rank_view: bool = True
    """At log steps, show the min/max over all ranks of step time, data-loading time and peak memory with the rank of each (one small all-reduce)."""


@dataclass
class Profiling:
    enable_profiling: bool = False
    """Record torch.profiler traces."""

    save_traces_folder: str = "profile_traces"
    """Trace folder, relative to job.dump_folder."""

    profile_freq: int = 100
    """Record a trace every this many steps (the recorded steps end on its multiples)."""

    profiler_warmup: int = 3
    """Steps profiled and discarded before each recorded window (the profiler's own start-up cost)."""

    profiler_active: int = 1
    """Steps recorded in each trace."""

    enable_memory_snapshot: bool = False
    """Record CUDA memory-history snapshots (CUDA only)."""

    save_memory_snapshot_folder: str = "memory_snapshot"
    """Memory snapshot folder, relative to job.dump_folder."""


@dataclass
class Comm:
    init_timeout_seconds: int = 300
    """Timeout for process-group creation and the first collectives."""

    train_timeout_seconds: int = 100
    """Timeout for collectives once training has started."""


@dataclass
class Validation:
    enable: bool = False
    """Evaluate loss and perplexity on a held-out split during training."""

    dataset: str = "test_corpus"
    """Validation dataset name (see training.dataset)."""

    dataset_path: str | None = None
    """Local file or folder for the validation dataset."""

    freq: int = 500
    """Validate every this many steps."""

    steps: int = -1
    """Batches per validation; -1 runs over the whole split once."""


@dataclass
class Debug:
    seed: int = 0
    """Seed for weights, data order and dropout; the same seed gives the same weights at any parallelism."""

    deterministic: bool = False
    """Use deterministic algorithms (slower; for bitwise reproducibility)."""


@dataclass
class Sft:
    packing: Literal["pack", "pad"] = "pack"
    """With training.dataset = chat: pack conversations into each row of seq_len tokens (with model.attn_mask_type = block_causal they cannot attend to each other) or pad one conversation per row (docs/sft.md)."""

    overlong: Literal["truncate", "drop", "error"] = "truncate"
    """A conversation longer than training.seq_len + 1 tokens is truncated (dropped if no assistant token is left), dropped, or an error naming its file and line (checked before training)."""

    chat_template: Literal["auto", "default", "tokenizer"] = "auto"
    """How conversations are rendered: the tokenizer's own chat_template (Jinja) when it has one (auto) or always (tokenizer), else the documented default template of docs/sft.md (default)."""


@dataclass
class Lora:
    enable: bool = False
    """Train low-rank adapters on a frozen base (LoRA; docs/lora.md): no base gradients or optimizer state; checkpoints hold the adapters only."""

    rank: int = 8
    """Adapter rank r."""

    alpha: float = 16.0
    """Adapter scaling numerator: the update is scaled by alpha / r (alpha / sqrt(r) with use_rslora)."""

    dropout: float = 0.0
    """Dropout on the adapter's input."""

    use_rslora: bool = False
    """Rank-stabilised scaling alpha / sqrt(r)."""

    target_modules: list[str] = field(
        default_factory=lambda: ["attention.wq", "attention.wk", "attention.wv", "attention.wo"]
    )
    """Module-name patterns (fnmatch, matched against the module's name or a dotted suffix of it) that get adapters: nn.Linear projections or grouped MoE experts (feed_forward.experts)."""

    adapter_path: str = ""
    """A PEFT adapter folder (adapter_config.json + adapter_model.safetensors) to start the adapters from, written for the same rank, alpha and use_rslora (docs/lora.md)."""

    quantize_base: Literal["none", "nf4"] = "none"
    """Store the frozen base's adapted projections in NF4 (QLoRA, torchao; one process only)."""


@dataclass
class FaultTolerance:
    watchdog_timeout_seconds: float = 0.0
    """When a training step runs longer than this, every rank writes the Python stacks of all its threads and the phase it waits in to <dump_folder>/<watchdog_folder>/ (with the NCCL flight recorder's trace on CUDA); must be shorter than comm.train_timeout_seconds. 0 turns the watchdog off. Armed from step 2 (step 1 includes warm-up)."""

    watchdog_folder: str = "watchdog"
    """Folder for the watchdog's dumps, relative to job.dump_folder."""

    straggler_margin: float = 0.0
    """Flag a rank whose step or data time exceeds the fastest rank's by more than this fraction (e.g. 0.5 = 50%), at straggler_log_steps consecutive log steps; 0 turns it off. Uses the cross-rank view (turned on with it)."""

    straggler_log_steps: int = 3
    """Consecutive log steps a rank must be slow before it is flagged as a straggler."""


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    quantize: Quantize = field(default_factory=Quantize)
    metrics: Metrics = field(default_factory=Metrics)
    profiling: Profiling = field(default_factory=Profiling)
    comm: Comm = field(default_factory=Comm)
    validation: Validation = field(default_factory=Validation)
    debug: Debug = field(default_factory=Debug)
    sft: Sft = field(default_factory=Sft)
    lora: Lora = field(default_factory=Lora)
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
