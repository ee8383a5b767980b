"""The job configuration: one dataclass per TOML section, a docstring on every field.

The attribute docstrings are read by ``torchtitan.config.manager`` and become ``--help`` and
``docs/config.md``; keep each one a sentence or two that says what the field does and its units.
Cross-field rules live in ``torchtitan.config.validate``.
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


@dataclass
class Model:
    name: str = "llama3"
    """Model family; a key of ``torchtitan.models.MODELS``."""

    flavor: str = "debugmodel"
    """Size of the model within its family (llama3: debugmodel, 1B, 8B, 70B, 405B)."""

    tokenizer_path: str = "tests/assets/tokenizer"
    """tiktoken BPE ranks file, or a folder holding ``tokenizer.model``."""


@dataclass
class Training:
    dataset: str = "test_corpus"
    """Dataset name: ``test_corpus`` (shipped), ``json``/``parquet``/``text`` with dataset_path, or a hub name."""

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
    """Microbatches per pipeline step; -1 uses the number of pipeline stages."""

    pipeline_parallel_split_points: list[str] = field(default_factory=list)
    """Layer names where a new pipeline stage starts, e.g. layers.4,layers.8; empty splits evenly."""

    pipeline_parallel_layers_per_stage: int = -1
    """Transformer layers per pipeline stage when splitting evenly; -1 derives it from the stage count."""

    context_parallel_degree: int = 1
    """Context parallel degree: the sequence is sharded over this many ranks."""


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


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "full", "selective"] = "none"
    """Recompute activations in backward: none, full (every block) or selective."""

    selective_ac_option: str = "2"
    """For selective mode: an integer N checkpoints every Nth block; 'op' saves matmul outputs and recomputes cheap ops."""


@dataclass
class Compile:
    enable: bool = False
    """torch.compile each transformer block (fullgraph) and the loss."""


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


@dataclass
class Profiling:
    enable_profiling: bool = False
    """Record torch.profiler traces."""

    save_traces_folder: str = "profile_traces"
    """Trace folder, relative to job.dump_folder."""

    profile_freq: int = 100
    """Record a trace every this many steps."""

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
