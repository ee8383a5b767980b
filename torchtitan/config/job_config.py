"""The job configuration: one dataclass per TOML section, a docstring on every field (the core
sections here, the rest in ``sections.py``; ``JobConfig`` puts them together).

The attribute docstrings become ``--help`` and ``docs/config.md`` (``torchtitan.config.manager``);
keep each a sentence or two: what the field does, its units. Cross-field rules: ``preflight/``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from torchtitan.config.sections import (
    ActivationCheckpoint,
    Checkpoint,
    Comm,
    Compile,
    Debug,
    Dpo,
    Eval,
    FaultTolerance,
    Grpo,
    Lora,
    Metrics,
    Profiling,
    Quantize,
    Sft,
    Validation,
)


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

    fit_check: Literal["error", "warn", "off"] = "error"
    """At launch (run_train.sh, torchtitan.train; not when only validating with python -m torchtitan.config, which checks it only with --launch), compare the estimated peak memory per rank with this machine's free GPU memory (CUDA) or, times the ranks on the host, its available host memory (CPU; and FSDP CPU offload's host side): error refuses a job that does not fit, warn only warns, off skips the check. Above 90% it warns (docs/planning.md, "Fit before launch")."""


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
    """Kernel for block_causal attention: sdpa (a dense boolean mask, exact, any device), flex (FlexAttention with a block mask built once per batch, or per layer forward under context parallel from the gathered keys; CUDA, skips blocks between documents; all-gather CP only) or auto (flex on CUDA without context parallel, else sdpa). Causal attention always uses SDPA."""

    n_layers: int = -1
    """Number of transformer blocks, every other dimension kept (e.g. ``--model.flavor 30B-A3B --model.n_layers 4``: the published expert shapes at 4 blocks, for benchmarks); -1 keeps the flavor's. DeepSeek-V3 keeps its dense first blocks' share of the depth, at least one and at least one MoE block (docs/moe.md)."""

    moe_aux_loss_coef: float = -1.0
    """MoE flavors: coefficient of the load-balancing auxiliary loss (0 turns it off); -1 keeps the flavor's (docs/moe.md)."""

    moe_bias_update_rate: float = -1.0
    """MoE flavors: step of the auxiliary-loss-free routing bias per optimizer step (0 turns it off); -1 keeps the flavor's."""

    moe_num_experts: int = -1
    """MoE flavors: routed experts per MoE layer, their width and top-k kept (a benchmark of DeepSeek-V3 671B's expert shape on one GPU: --model.n_layers 4 --model.moe_num_experts 16); -1 keeps the flavor's."""

    mtp_depth: int = -1
    """Multi-token prediction (deepseek_v3): number of MTP modules, each predicting one token further (0 turns it off); -1 keeps the flavor's (docs/deepseek_v3.md)."""

    mtp_loss_weight: float = -1.0
    """Multi-token prediction: weight lambda of the MTP loss lambda / D * sum_k CE_k added to the main loss (0 trains nothing through it); -1 keeps the flavor's."""

    hf_trust_remote_code: bool = False
    """hf family: build a folder whose config.json names remote code (``auto_map``) through transformers' ``trust_remote_code`` path. RISK: the folder's Python files then run with this process's rights (they can read, write and send anything it can); turn it on only for a folder whose code you have read or trust. Off, such a folder is refused (docs/hf_models.md). Other families refuse it on."""


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
    mode: Literal["lm", "dpo", "grpo"] = "lm"
    """What a step trains: lm (next-token loss: pre-training, SFT), dpo (preference pairs of [dpo]) or grpo (sampled completions scored by the rewards of [grpo]); docs/posttrain.md."""

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

    image_tokens_per_sample: int = 0
    """Vision-language models: the mean merged image tokens per sample (row) of the training data, counted as one image per sample; the vision tower's training FLOPs for their patches (image tokens x spatial_merge_size^2) are added to the FLOPs per token behind MFU, benchmarks/throughput.py and the planner. 0 counts the decoder only (docs/vlm.md, "Planning")."""


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
    """How attention sees the whole sequence under context parallel: allgather (K/V all-gathered over cp, exact, any device) or ring (K/V shards passed around the cp ranks: torch's experimental ring attention for causal, CUDA only; our document ring for block_causal, any device)."""

    context_parallel_rotate_method: Literal["allgather", "alltoall"] = "allgather"
    """For context_parallel_method ring with causal attention: how torch rotates the K/V shards between cp ranks (the block_causal ring passes them point to point)."""

    context_parallel_load_balancer: Literal["headtail", "document"] = "headtail"
    """Which tokens each cp rank holds: headtail (chunks r and 2cp-1-r of the sequence: equal causal work) or document (chunks r and 2cp-1-r of every packed document: equal block-causal work with documents of mixed lengths; needs model.attn_mask_type block_causal). docs/context_parallel.md."""

    expert_parallel_degree: int = 1
    """Expert parallel degree (MoE models): the routed experts are split over this many ranks, borrowed from data_parallel_shard_degree (which it must divide); tokens reach their experts by all-to-all. Experts are FSDP-sharded over the remaining dp_shard / ep ranks (docs/parallelisms.md)."""

    auto: bool = False
    """Choose the layout at launch: the planner's fastest layout that fits (python -m torchtitan.planner) replaces the degrees, pipeline schedule and microbatches, local batch, activation checkpointing and memory levers set here; the global batch stays. The log names the choice, the runner-up and the override line that pins it (docs/planning.md)."""

    fsdp_cpu_offload: bool = False
    """FSDP2 CPU offload (CPUOffloadPolicy): parameter shards, gradients and optimizer state live in host memory and the optimizer step runs on the CPU; needs FSDP (data_parallel_shard_degree > 1, with or without HSDP, TP, PP); the offload slows each step by the host-device copies (docs/memory.md)."""


@dataclass
class OptimizerGroup:
    kinds: list[str] = field(default_factory=list)
    """Parameter kinds this rule takes, any of matrix, embedding, output, norm, bias, router, experts, other (docs/optimizers.md); empty: every kind."""

    names: list[str] = field(default_factory=list)
    """Shell-style patterns on full parameter names (e.g. "layers.*.attention.wq.weight"); empty: every name. A parameter matches when its kind and its name both match."""

    optimizer: Literal["default", "AdamW", "Muon"] = "default"
    """Update rule of the matched parameters: default (the kind's, docs/optimizers.md), AdamW, or Muon (matrices and experts only, with optimizer.name = "Muon")."""

    lr_mult: float = 1.0
    """Multiplier of optimizer.lr (and of its whole schedule) for the matched parameters."""

    weight_decay: float = -1.0
    """Decoupled weight decay of the matched parameters; -1 keeps the kind's default (docs/optimizers.md)."""


@dataclass
class Optimizer:
    name: Literal["AdamW", "Adam", "Muon"] = "AdamW"
    """AdamW or Adam from torch.optim, or Muon: orthogonalised momentum for weight matrices and expert matrices, AdamW for the rest (docs/optimizers.md)."""

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

    groups: list[OptimizerGroup] = field(default_factory=list)
    """Parameter-group rules, as [[optimizer.groups]] tables (TOML; --optimizer.groups.N.field overrides a field of table N): the first rule a parameter matches sets its optimizer, lr multiplier and weight decay; unmatched parameters keep their kind's defaults; a rule that matches no parameter is an error (docs/optimizers.md)."""

    muon_momentum: float = 0.95
    """Muon's momentum coefficient mu (the buffer is m = mu m + (1 - mu) g)."""

    muon_nesterov: bool = True
    """Muon orthogonalises the Nesterov look-ahead (1 - mu) g + mu m instead of m."""

    muon_ns_steps: int = 5
    """Newton-Schulz iterations of Muon's orthogonalisation."""

    muon_ns_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """dtype of the Newton-Schulz iteration and of its gathers: auto is bfloat16 on CUDA (as published) and float32 elsewhere."""

    muon_update_scale: Literal["match_rms_adamw", "original"] = "match_rms_adamw"
    """Scale of Muon's orthogonal update: match_rms_adamw is 0.2 sqrt(max(m, n)) (Moonlight: one lr fits Muon and AdamW groups), original is sqrt(max(1, rows / cols)) (Keller Jordan)."""


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
    eval: Eval = field(default_factory=Eval)
    debug: Debug = field(default_factory=Debug)
    sft: Sft = field(default_factory=Sft)
    lora: Lora = field(default_factory=Lora)
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
    dpo: Dpo = field(default_factory=Dpo)
    grpo: Grpo = field(default_factory=Grpo)
