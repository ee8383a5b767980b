"""The job configuration's sections beyond the core ones of ``job_config.py``: checkpointing,
activation checkpointing, compile, quantization, metrics, profiling, communication timeouts,
validation, debugging, SFT and fault tolerance. Same rules: one dataclass per TOML section, a
docstring on every field (it becomes ``--help`` and ``docs/config.md``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

CHECKPOINT_PARTS = frozenset(
    {"model", "optimizer", "lr_scheduler", "train_state", "dataloader", "rng"}
)
"""The parts every checkpoint holds (``checkpoint/manager.py``)."""
POSTTRAIN_PART = "posttrain"  # training.mode dpo/grpo: the frozen reference, sampling generators
DILOCO_PART = "diloco"  # fault_tolerance.semi_sync = "diloco": the outer optimizer's state
OPTIONAL_CHECKPOINT_PARTS = frozenset({POSTTRAIN_PART, DILOCO_PART})
"""Parts a checkpoint holds only in the runs that add them (``Trainer._checkpoint_extra``)."""


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
    """Parts of a checkpoint not to load: any of model, optimizer, lr_scheduler, dataloader, train_state (then training restarts at step 0), rng, and the parts some runs add: posttrain (dpo/grpo), diloco (fault_tolerance.semi_sync = "diloco")."""

    initial_load_path: str = ""
    """When the checkpoint folder holds no checkpoint yet (or checkpoint.enable is off), load initial weights from this step-N folder (e.g. made by scripts/convert_from_hf.py), or from a Hugging Face folder with initial_load_in_hf; empty starts from random weights."""

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
class ExpertsFloat8:
    enable: bool = False
    """Run the routed experts' grouped GEMMs (forward and both backward GEMMs) in float8 with rowwise power-of-2 scales, torchao's MoE recipe (docs/float8.md, "Float8 experts"); the router, shared experts and LoRA adapters stay in high precision. Needs an MoE flavor and, on CUDA, compute capability >= 8.9 (else emulate)."""

    emulate: bool = False
    """Emulate the experts' float8 GEMMs (same rounding, fp32 products, no speed-up): for checking numerics on GPUs without float8 tensor cores; always on for CPU."""


@dataclass
class MoEQuantize:
    float8: ExpertsFloat8 = field(default_factory=ExpertsFloat8)
    """Float8 training of the routed experts."""


@dataclass
class Quantize:
    dense: DenseQuantize = field(default_factory=DenseQuantize)
    """Quantized training of dense layers."""

    moe: MoEQuantize = field(default_factory=MoEQuantize)
    """Quantized training of the Mixture-of-Experts layers' routed experts."""


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
class FaultTolerance:
    watchdog_timeout_seconds: float = 0.0
    """When a training step runs longer than this, every rank writes the Python stacks of all its threads and the phase it waits in to <dump_folder>/<watchdog_folder>/ (with the NCCL flight recorder's trace on CUDA); must be shorter than comm.train_timeout_seconds. 0 turns the watchdog off. Armed from step 2 (step 1 includes warm-up)."""

    watchdog_folder: str = "watchdog"
    """Folder for the watchdog's dumps, relative to job.dump_folder."""

    straggler_margin: float = 0.0
    """Flag a rank whose step or data time exceeds the fastest rank's by more than this fraction (e.g. 0.5 = 50%), at straggler_log_steps consecutive log steps; 0 turns it off. Uses the cross-rank view (turned on with it)."""

    straggler_log_steps: int = 3
    """Consecutive log steps a rank must be slow before it is flagged as a straggler."""

    enable: bool = False
    """Replica fault tolerance with torchft (docs/fault_tolerance.md): this job is one replica group of group_size; the groups average gradients through a torchft Manager, a dead group is dropped from the quorum and a restarted one fetches its state live from a healthy peer. Each group is its own torchrun job with parallelism.data_parallel_replicate_degree 1 inside it."""

    replica_id: int = 0
    """This job's replica group, 0..group_size-1 (it also picks the group's share of the data)."""

    group_size: int = 0
    """Number of replica groups (torchrun jobs) in the run; at least 2 with enable."""

    lighthouse: str = ""
    """Address of torchft's lighthouse (e.g. http://host:29510); empty reads TORCHFT_LIGHTHOUSE. run_train.sh can start one (docs/fault_tolerance.md)."""

    min_replicas: int = 1
    """A step commits only while at least this many replica groups take part; below it the job stops with a message."""

    quorum_timeout_seconds: float = 60.0
    """How long a step waits for the replica groups' quorum."""

    connect_timeout_seconds: float = 10.0
    """How long connecting to the lighthouse or a peer's manager may take."""

    timeout_seconds: float = 60.0
    """Timeout of the cross-replica collectives and of a live recovery's transfer."""

    quorum_retries: int = 3
    """Times a failed quorum request is retried before the job stops: a lighthouse restarted within them is survived."""

    semi_sync: Literal["none", "local_sgd", "diloco"] = "none"
    """Semi-synchronous training across the replica groups (docs/fault_tolerance.md): none averages gradients every step; local_sgd steps each group alone and averages the parameters every sync_every steps; diloco averages the pseudo-gradients (last synced weights minus local weights) every sync_every steps and applies them with an outer Nesterov SGD (outer_lr, outer_momentum). Built on torchft's LocalSGD and DiLoCo."""

    sync_every: int = 1
    """Steps between two syncs of the replica groups under semi_sync local_sgd or diloco."""

    outer_lr: float | None = None
    """DiLoCo's outer SGD learning rate (semi_sync diloco only; unset means 0.7, the DiLoCo paper's)."""

    outer_momentum: float | None = None
    """DiLoCo's outer Nesterov momentum (semi_sync diloco only; unset means 0.9, the DiLoCo paper's; 0 is plain SGD)."""


@dataclass
class Eval:
    tasks: list[str] = field(default_factory=list)
    """lm-evaluation-harness tasks (stock names, or local ones under include_path) run by python -m torchtitan.eval, and in training every freq steps (docs/evaluation.md)."""

    include_path: list[str] = field(default_factory=lambda: ["tests/assets/eval"])
    """Folders of local task YAMLs; a relative data_files entry in one is read from its YAML's folder."""

    freq: int = 0
    """In training, evaluate every this many steps (0: never); the time is reported and kept out of tokens/s."""

    limit: int = -1
    """Documents per task (the first ones); -1 evaluates all."""

    num_fewshot: int = -1
    """Few-shot examples per prompt; -1 keeps each task's own setting."""

    batch_size: int = 8
    """Requests per forward on each data-parallel rank."""

    max_gen_tokens: int = 256
    """Most tokens one generation request produces, unless its task sets max_gen_toks."""

    checkpoint: str = ""
    """python -m torchtitan.eval: a step-N folder or checkpoint root (DCP), or a Hugging Face folder (holding config.json); empty takes the newest under job.dump_folder/checkpoint.folder."""


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

    target_modules: list[str] = field(default_factory=list)
    """Empty (default): the family's attention projections (``lora_targets`` of its spec: wq, wk,
    wv, wo; DeepSeek-V3's MLA wq/wq_a/wq_b/wkv_a/wkv_b/wo). Otherwise module-name patterns (fnmatch, matched against the module's name or a dotted suffix of it) that get adapters: nn.Linear projections or the stacked MoE experts of any family (feed_forward.experts)."""

    adapter_path: str = ""
    """A PEFT adapter folder (adapter_config.json + adapter_model.safetensors) to start the adapters from, written for the same rank, alpha and use_rslora and, by default, for exactly the modules target_modules adapts: an adapter the folder has and the config leaves out, or the reverse, is refused before launch (docs/lora.md)."""

    adapter_targets: Literal["config", "from_adapter"] = "config"
    """Which modules get adapters when adapter_path is set: ``config`` (default) those of target_modules, which must be exactly the folder's; ``from_adapter`` every module the folder adapts (target_modules must then be empty)."""

    quantize_base: Literal["none", "nf4"] = "none"
    """Store the frozen base's adapted projections in NF4 (QLoRA, torchao): one process, FSDP (dp_shard) or PP; TP, CP and replication are refused (docs/lora.md)."""


@dataclass
class Dpo:
    dataset_path: str = ""
    """training.mode = dpo: the preference pairs, a JSONL file of {"prompt", "chosen", "rejected"} records or a folder saved by datasets.Dataset.save_to_disk (docs/posttrain.md)."""

    loss_type: Literal["sigmoid", "hinge", "ipo", "robust", "simpo"] = "sigmoid"
    """DPO loss (TRL's formulas): sigmoid (DPO), hinge, ipo, robust (label smoothing), or simpo (reference-free)."""

    beta: float = 0.1
    """Inverse temperature of the preference loss (> 0)."""

    label_smoothing: float = 0.0
    """Assumed label noise in [0, 0.5), for loss_type robust or simpo only."""

    simpo_gamma: float = 0.5
    """SimPO's target reward margin (loss_type simpo only)."""

    reference: Literal["auto", "adapters_off", "frozen_copy"] = "auto"
    """The reference model: adapters_off (LoRA: the base with the adapters off, no memory), frozen_copy (a frozen copy of this rank's parameter shards, checkpointed), or auto (adapters_off under lora.enable, else frozen_copy). Not used by simpo."""


@dataclass
class Grpo:
    prompts_path: str = ""
    """training.mode = grpo: a JSONL file of {"prompt": str | messages, "answer": str} records (docs/posttrain.md)."""

    k: int = 4
    """Completions sampled per prompt (>= 2: with one, every group-normalised advantage is 0)."""

    prompts_per_step: int = 8
    """Prompts per optimizer step over all data-parallel ranks (a multiple of the data-parallel degree)."""

    rewards: list[str] = field(default_factory=lambda: ["exact_match"])
    """Reward functions, summed: exact_match, format, or a user callable 'package.module:function' taking (completion, answer) and returning a float."""

    reward_weights: list[float] = field(default_factory=list)
    """A weight per reward function; empty weighs each 1.0."""

    max_new_tokens: int = 8
    """Tokens generated per completion."""

    temperature: float = 1.0
    """Sampling temperature (> 0)."""

    top_k: int = 0
    """Sample among the k most likely tokens only; 0 samples from all."""

    epsilon_low: float = 0.2
    """Lower clip of the policy ratio (1 - epsilon_low)."""

    epsilon_high: float = 0.2
    """Upper clip of the policy ratio (1 + epsilon_high)."""

    kl_coef: float = 0.0
    """Weight of the k3 KL estimate to the reference (a frozen copy of the starting policy, or the base with the adapters off under LoRA); 0 builds no reference."""

    loss_type: Literal["grpo", "bnpo", "dr_grpo"] = "grpo"
    """Loss averaging: grpo (sequence level: each completion's token mean, then the mean over completions), bnpo (token level: mean over every completion token), dr_grpo (token sum over completions x max_new_tokens)."""

    scale_rewards: bool = True
    """Divide each group's centred rewards by the group's standard deviation."""

    seed: int = 0
    """Seed of the sampling generator (data-parallel rank r uses seed + r); its state is checkpointed."""
