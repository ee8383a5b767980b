"""The shell commands of README.md, docs/*.md and the shipped configs' headers, and how each runs
in ``tests/unit/test_docs_commands.py`` (a doc cannot drift from the code).

A command is a logical line (``\\`` continuations joined, a trailing ``# comment`` dropped) of a
``bash`` block, or of an unlabelled block when it starts with a program below (unlabelled
blocks also hold output); in a TOML file, of the leading comment. ``COMMANDS`` maps each command,
exactly as written, to how the test runs it:

- ``Fast()``: as written, in the fast tier (in process for ``python -m torchtitan.{config,plan,
  train}``: config checks, ``--job.explain`` and the planner cost milliseconds there);
- ``Slow(extra)``: as written plus ``extra`` (small-size overrides), in the slow tier, in a
  sandbox folder that mirrors the repository (so ``outputs/`` is the sandbox's), in table order:
  a command may use what an earlier one wrote (the pre-training checkpoint, its HF export);
- ``Skip(reason)``: not run here (a GPU, a cluster, the network, a placeholder path...).

Every command, skipped or not, also gets the static check of the fast tier: each config override
(``--section.field``) names a field of ``JobConfig``, each config file it names exists, and each
option of one of our scripts appears in that script's ``--help``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROGRAMS = (
    "python",
    "./run_train.sh",
    "./run_tests.sh",
    "torchrun",
    "sbatch",
    "scripts/gpu_check.sh",
    "nvidia-smi",
)
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
_ENV = re.compile(r"[A-Z_][A-Z0-9_]*=\S*")


@dataclass(frozen=True)
class Fast:
    """Runs as written in the fast tier; exits ``rc`` and its output holds ``words``."""

    rc: int = 0
    words: str = ""


@dataclass(frozen=True)
class Slow:
    """Runs in the slow tier with ``extra`` appended; exits 0."""

    extra: str = ""


@dataclass(frozen=True)
class Skip:
    reason: str


Mode = Fast | Slow | Skip

GPU = "needs a CUDA GPU"
FT = "two jobs meeting at a lighthouse (tests/integration/test_fault_tolerance.py launches them)"
CLUSTER = "needs a SLURM cluster (multinode_trainer.slurm; test_launch_options.py checks its torchrun options)"
EIGHT = (
    "8 ranks of the debug model: too slow on 2 CPU cores (the layouts run in tests/distributed/)"
)
COMPILE = "torch.compile on CPU: minutes of inductor compilation per run (too slow for a doc check)"
FLOAT8 = "float8 linears need a CUDA GPU (sm89+); refused on CPU"
TESTS = "runs the test suite itself"
BENCH = "a benchmark: minutes of timing runs (its --help options are checked)"
PLACEHOLDER = "names a placeholder the reader fills in (its options are checked)"
BIG = "a checkpoint of a published size (8B+): too big for a doc check"
SMALL = (
    "--training.steps 2 --training.seq_len 64 --training.local_batch_size 2 --metrics.log_freq 1"
)
# keeps the step count (a later command reads step-60 / step-40), shrinks the rest
SHRINK = "--training.seq_len 32 --training.local_batch_size 2 --metrics.log_freq 20"
SFT_SMALL = "--training.seq_len 128 --training.local_batch_size 2 --validation.steps 2 --metrics.log_freq 20"

COMMANDS: dict[str, Mode] = {
    # docs/fault_tolerance.md
    "TORCHFT_LIGHTHOUSE=start LIGHTHOUSE_MIN_REPLICAS=1 ./run_train.sh --fault_tolerance.enable --fault_tolerance.group_size 2 --fault_tolerance.replica_id 0 --job.dump_folder outputs/group0": Skip(
        FT
    ),
    "TORCHFT_LIGHTHOUSE=http://localhost:29510 ./run_train.sh --fault_tolerance.enable --fault_tolerance.group_size 2 --fault_tolerance.replica_id 1 --job.dump_folder outputs/group1": Skip(
        FT
    ),
    # README.md
    "./run_train.sh": Slow(SMALL),
    "./run_tests.sh": Skip(TESTS),
    "./run_tests.sh --torch 2.11": Skip(TESTS + ", building a torch 2.11 venv (network)"),
    "./run_tests.sh --torch 2.15": Skip(TESTS + ", building a torch 2.15 venv (network)"),
    "./run_tests.sh --all": Skip(TESTS),
    "./run_tests.sh -m slow": Skip(TESTS),
    "NGPU=4 ./run_train.sh --training.steps 100 --metrics.log_freq 1": Slow(SMALL),
    "NGPU=4 ./run_train.sh --parallelism.data_parallel_shard_degree 2 "
    "--parallelism.data_parallel_replicate_degree 2": Slow(SMALL),
    "CONFIG_FILE=train_configs/llama3_8b.toml ./run_train.sh --training.local_batch_size 2": Skip(
        "trains Llama 3 8B on 8 GPUs (its config check runs: the llama3_8b.toml header)"
    ),
    "python -m torchtitan.train --job.config_file train_configs/debug_model.toml": Slow(SMALL),
    "NGPU=8 ./run_train.sh --parallelism.data_parallel_shard_degree 8": Skip(EIGHT),
    "NGPU=8 ./run_train.sh --parallelism.data_parallel_replicate_degree 2 "
    "--parallelism.data_parallel_shard_degree 4": Skip(EIGHT),
    "NGPU=4 ./run_train.sh --parallelism.data_parallel_replicate_degree 4 "
    "--parallelism.data_parallel_shard_degree 1": Slow(SMALL),
    "NGPU=8 ./run_train.sh --parallelism.data_parallel_shard_degree 4 "
    "--parallelism.tensor_parallel_degree 2": Skip(EIGHT),
    "NGPU=2 ./run_train.sh --parallelism.pipeline_parallel_degree 2": Slow(SMALL),
    "NGPU=8 ./run_train.sh --parallelism.data_parallel_shard_degree 2 "
    "--parallelism.tensor_parallel_degree 2 --parallelism.pipeline_parallel_degree 2 "
    "--parallelism.pipeline_parallel_schedule interleave_1f1b": Skip(EIGHT),
    "NGPU=2 ./run_train.sh --parallelism.context_parallel_degree 2 --training.seq_len 4096": Slow(
        "--training.steps 2 --training.local_batch_size 1 --training.seq_len 256"  # the last wins
    ),
    "python scripts/loss_compare.py A/metrics/rank_0.jsonl B/metrics/rank_0.jsonl --rtol 1e-5": Skip(
        PLACEHOLDER
    ),
    'python scripts/loss_compare.py --steps 20 --a "--training.local_batch_size 8" '
    '--b "--parallelism.tensor_parallel_degree 2" --ngpu-b 2': Skip(
        "two 20-step runs of the debug model: too slow for a doc check (tests/unit/test_loss_compare.py)"
    ),
    # the pre-training the conversion, SFT, LoRA, evaluation and generation commands start from
    "./run_train.sh --checkpoint.enable": Slow(SHRINK),
    "python -m torchtitan.convert to-hf outputs/debug_model/checkpoint/step-60 hf_out "
    "--model llama3 --flavor debugmodel": Slow(),
    "python -m torchtitan.convert from-hf hf_out outputs/imported --model llama3": Slow(),
    "./run_train.sh --checkpoint.initial_load_path HF_DIR --checkpoint.initial_load_in_hf": Skip(
        PLACEHOLDER
    ),
    "CONFIG_FILE=train_configs/sft_debug.toml ./run_train.sh "
    "--checkpoint.initial_load_path outputs/debug_model/checkpoint/step-60": Slow(
        "--training.steps 2 " + SFT_SMALL
    ),
    "CONFIG_FILE=train_configs/sft_debug.toml ./run_train.sh "
    "--checkpoint.initial_load_path ./outputs/debug_model/checkpoint/step-60": Slow(
        "--training.steps 2 " + SFT_SMALL
    ),
    "python scripts/convert_to_hf.py outputs/debug_model/checkpoint/step-60 outputs/hf_base": Slow(),
    # train_configs/debug_dpo.toml, debug_grpo.toml (docs/posttrain.md)
    "CONFIG_FILE=train_configs/debug_dpo.toml ./run_train.sh": Slow("--training.steps 2"),
    "CONFIG_FILE=train_configs/debug_grpo.toml ./run_train.sh": Slow(
        "--training.steps 2 --grpo.max_new_tokens 3"
    ),
    "CONFIG_FILE=train_configs/lora_debug.toml ./run_train.sh "
    "--checkpoint.initial_load_path outputs/hf_base --checkpoint.initial_load_in_hf": Slow(
        SFT_SMALL
    ),
    "python scripts/export_lora.py outputs/lora_debug/checkpoint/step-40 outputs/hf_base peft_out "
    "--job.config_file train_configs/lora_debug.toml": Slow(),
    "NGPU=1 CONFIG_FILE=train_configs/qlora_debug.toml ./run_train.sh "
    "--checkpoint.initial_load_path outputs/hf_base --checkpoint.initial_load_in_hf": Slow(
        "--training.steps 2 " + SFT_SMALL
    ),
    "python -m torchtitan.eval --job.config_file train_configs/debug_model.toml "
    "--eval.tasks torchtitan_facts_mc,torchtitan_facts_gen "
    "--eval.checkpoint outputs/debug_model/checkpoint": Slow(),
    'python scripts/generate.py outputs/debug_model/checkpoint --prompt "Once upon a time" '
    "--max_new_tokens 64": Slow(),
    'torchrun --nproc_per_node 2 scripts/generate.py hf_out --hf --prompt "..." '
    "--temperature 0.8 --top_k 50 --tp 2": Slow(),
    "./run_train.sh --validation.enable --validation.freq 100 --validation.steps 10": Slow(SMALL),
    "./run_train.sh --profiling.enable_profiling --profiling.profile_freq 100": Slow(SMALL),
    "./run_train.sh --training.nonfinite_policy skip_step": Slow(SMALL),
    "python scripts/plot_metrics.py outputs/run_a outputs/run_b --out plots/": Skip(PLACEHOLDER),
    "./run_train.sh --compile.enable": Skip(COMPILE),
    "./run_train.sh --activation_checkpoint.mode selective "
    "--activation_checkpoint.selective_ac_option op": Slow(SMALL),
    "./run_train.sh --quantize.dense.float8.enable": Skip(FLOAT8),
    "python benchmarks/throughput.py -- --job.config_file train_configs/debug_model.toml "
    "--compile.enable": Skip(BENCH),
    "python benchmarks/throughput.py --ladder -- --job.config_file train_configs/debug_model.toml": Skip(
        BENCH
    ),
    "python benchmarks/overhead.py -- --job.config_file train_configs/debug_model.toml": Skip(
        BENCH
    ),
    "python -m torchtitan.config --job.config_file train_configs/debug_model.toml "
    "--parallelism.data_parallel_shard_degree 3 --world_size 8": Fast(
        2, "8 ranks cannot hold dp_shard=3 (= 3 ranks)"
    ),
    # docs/checkpoint.md
    "NGPU=1 ./run_train.sh --checkpoint.enable --checkpoint.create_seed_checkpoint": Slow(
        "--job.dump_folder outputs/seed"  # the debug folder holds the pre-training's step-60
    ),
    "NGPU=8 ./run_train.sh --checkpoint.enable --parallelism.tensor_parallel_degree 2": Skip(EIGHT),
    # docs/configs.md
    "python -m torchtitan.train --job.config_file train_configs/llama3_8b.toml "
    "--job.config_file my_overlay.toml": Skip(PLACEHOLDER + ": my_overlay.toml, test_compose.py"),
    "python -m torchtitan.train --job.config_file train_configs/llama3_8b.toml,my_overlay.toml": Skip(
        PLACEHOLDER + ": my_overlay.toml"
    ),
    "CONFIG_FILE=train_configs/llama3_8b.toml,my_overlay.toml ./run_train.sh": Skip(
        PLACEHOLDER + ": my_overlay.toml"
    ),
    "python -m torchtitan.config --job.config_file train_configs/llama3_70b.toml --sources "
    "--world_size 256": Fast(0, "# train_configs/llama3_70b.toml"),
    # docs/context_parallel.md
    "NGPU=8 ./run_train.sh --parallelism.context_parallel_degree 2 "
    "--parallelism.tensor_parallel_degree 2 --parallelism.data_parallel_shard_degree 2 "
    "--training.seq_len 8192": Skip(EIGHT),
    # docs/data.md
    "python scripts/pretokenize.py --dataset test_corpus --split train "
    "--tokenizer tests/assets/tokenizer --out /data/test_corpus_tokens --workers 4": Skip(
        "writes to /data (its options are checked; tests/unit/test_pretokenize.py runs it)"
    ),
    "python scripts/pretokenize.py --dataset json --dataset-path /data/my_jsonl_folder "
    "--out /data/mine": Skip(PLACEHOLDER),
    "python scripts/pretokenize.py --dataset allenai/c4 --out /data/c4_tokens --workers 16": Skip(
        "downloads c4 from the Hugging Face hub (network)"
    ),
    "python benchmarks/dataloader.py --corpus-gib 2.0": Skip(BENCH),
    # docs/evaluation.md
    "torchrun --nproc_per_node 4 -m torchtitan.eval ... --parallelism.tensor_parallel_degree 2": Skip(
        "a synopsis ('...' stands for the options above)"
    ),
    # docs/float8.md
    "./run_train.sh --quantize.dense.float8.enable --quantize.dense.float8.recipe_name rowwise": Skip(
        FLOAT8
    ),
    "./run_train.sh --parallelism.data_parallel_shard_degree 8 --compile.enable "
    "--quantize.dense.float8.enable --quantize.dense.float8.enable_fsdp_float8_all_gather "
    "--quantize.dense.float8.precompute_float8_dynamic_scale_for_fsdp": Skip(FLOAT8),
    # docs/generation.md
    'python scripts/generate.py outputs/debug_model/checkpoint --prompt "Once upon a time"': Slow(),
    'python scripts/generate.py outputs/debug_model/checkpoint/step-60 --prompt "..." '
    "--max_new_tokens 128": Slow(),
    'python scripts/generate.py hf_out --hf --prompt "..."': Slow(),
    'python scripts/generate.py CKPT --prompt "..." --temperature 0.8 --top_k 50 --seed 1': Skip(
        PLACEHOLDER
    ),
    'torchrun --nproc_per_node 2 scripts/generate.py CKPT --prompt "..." --tp 2': Skip(PLACEHOLDER),
    # docs/hf_io.md
    "python -m torchtitan.convert to-hf outputs/run/checkpoint/step-1000 hf_out --model llama3 "
    "--flavor 8B --dtype bfloat16 [--max-shard-gb 5] [--max-seq-len 8192]": Skip(BIG),
    "python -m torchtitan.convert from-hf hf_folder outputs/imported --model qwen3 [--flavor 8B]": Skip(
        PLACEHOLDER
    ),
    "torchrun --nproc_per_node 4 -m torchtitan.convert from-hf hf_folder out --model llama3": Skip(
        PLACEHOLDER
    ),
    # docs/moe.md
    "CONFIG_FILE=train_configs/debug_model.toml ./run_train.sh --model.name qwen3 "
    "--model.flavor debugmodel": Slow(SMALL),
    "CONFIG_FILE=train_configs/debug_model.toml ./run_train.sh --model.name qwen3 "
    "--model.flavor debugmodel_moe --model.tokenizer_path tests/assets/hf_tokenizer": Slow(SMALL),
    "python -m torchtitan.config --job.config_file train_configs/qwen3_30b_a3b.toml "
    "--world_size 16": Fast(),
    # docs/multinode.md and the big configs' launch lines
    "CONFIG_FILE=train_configs/llama3_8b.toml sbatch --nodes 1 scripts/multinode_trainer.slurm": Skip(
        CLUSTER
    ),
    "CONFIG_FILE=train_configs/llama3_70b.toml sbatch --nodes 32 scripts/multinode_trainer.slurm": Skip(
        CLUSTER
    ),
    "CONFIG_FILE=train_configs/llama3_405b.toml sbatch --nodes 64 scripts/multinode_trainer.slurm "
    "--checkpoint.enable": Skip(CLUSTER),
    "torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint node0:29500 "
    "--rdzv_id myrun -m torchtitan.train --job.config_file train_configs/llama3_8b.toml": Skip(
        CLUSTER
    ),
    "CONFIG_FILE=train_configs/llama3_405b.toml sbatch --nodes 64 scripts/multinode_trainer.slurm": Skip(
        CLUSTER
    ),
    "CONFIG_FILE=train_configs/deepseek_v3_671b.toml sbatch --nodes 256 "
    "scripts/multinode_trainer.slurm": Skip(CLUSTER),
    "CONFIG_FILE=train_configs/qwen3_30b_a3b.toml sbatch --nodes 2 scripts/multinode_trainer.slurm": Skip(
        CLUSTER
    ),
    "NGPU=8 CONFIG_FILE=train_configs/deepseek_v3_16b.toml ./run_train.sh": Skip(GPU + " x 8"),
    "NGPU=8 CONFIG_FILE=train_configs/gpt_oss_20b.toml ./run_train.sh": Skip(GPU + " x 8"),
    "NGPU=8 CONFIG_FILE=train_configs/llama3_8b.toml ./run_train.sh": Skip(GPU + " x 8"),
    "NGPU=8 CONFIG_FILE=train_configs/qwen3_8b.toml ./run_train.sh": Skip(GPU + " x 8"),
    # docs/observability.md
    "LOG_RANK=0,3 NGPU=4 ./run_train.sh --parallelism.pipeline_parallel_degree 2 "
    "--training.steps 10 --training.seq_len 128 --metrics.log_freq 2 --validation.enable "
    "--validation.freq 5 --validation.steps 4": Slow("--training.steps 5"),
    "python scripts/plot_metrics.py outputs/run_a outputs/run_b --label baseline "
    "--label fsdp+tp --out plots/": Skip(PLACEHOLDER),
    # docs/optimizers.md
    "OMP_NUM_THREADS=1 python benchmarks/muon_comm.py --steps 5": Skip(BENCH),
    "OMP_NUM_THREADS=1 python benchmarks/muon_comm.py --flavor 1B --layers 1 --steps 1": Skip(
        BENCH
    ),
    "OMP_NUM_THREADS=1 python -m torchtitan.train --job.config_file train_configs/debug_model.toml "
    "--training.steps 300 --training.seq_len 64 --training.local_batch_size 8 "
    "--training.mixed_precision_param float32 --metrics.log_freq 10 "
    "--lr_scheduler.warmup_steps 30 --optimizer.name Muon --optimizer.lr 2e-3": Slow(
        "--training.steps 3"
    ),
    # docs/parallelisms.md
    "NGPU=8 ./run_train.sh --parallelism.fsdp_reshard_after_forward never": Skip(EIGHT),
    "NGPU=2 ./run_train.sh --parallelism.tensor_parallel_degree 2": Slow(SMALL),
    "NGPU=2 ./run_train.sh --parallelism.tensor_parallel_degree 2 "
    "--parallelism.disable_loss_parallel": Slow(SMALL),
    "NGPU=8 ./run_train.sh --parallelism.data_parallel_shard_degree 4 "
    "--parallelism.tensor_parallel_degree 2 --parallelism.enable_async_tensor_parallel "
    "--compile.enable": Skip(GPU + " (async TP)"),
    "--model.flavor 70B --parallelism.data_parallel_shard_degree 32 "
    "--parallelism.tensor_parallel_degree 8": Skip("overrides, not a command (the 70B layout)"),
    "--model.flavor 405B --parallelism.data_parallel_shard_degree 8 "
    "--parallelism.tensor_parallel_degree 8 --parallelism.pipeline_parallel_degree 8 "
    "--parallelism.pipeline_parallel_schedule interleave_1f1b": Skip(
        "overrides, not a command (the 405B layout)"
    ),
    "python scripts/loss_compare.py outputs/a/metrics/rank_0.jsonl outputs/b/metrics/rank_0.jsonl "
    "--rtol 1e-5": Skip(PLACEHOLDER),
    'python scripts/loss_compare.py --steps 20 --common "--training.seq_len 64 '
    '--training.global_batch_size 8 --training.mixed_precision_param float32" '
    '--a "--training.local_batch_size 8" --ngpu-a 1 --b "--training.local_batch_size 4 '
    '--parallelism.tensor_parallel_degree 2" --ngpu-b 4': Skip(
        "two 20-step runs (1 and 4 ranks): too slow for a doc check (test_loss_compare.py)"
    ),
    # docs/performance.md
    "python benchmarks/vlm_throughput.py --samples 64 --warmup 2 --steps 8 --threads 1": Skip(
        BENCH
    ),
    "python benchmarks/vlm_throughput.py --samples 64 --warmup 2 --steps 8 --threads 1 "
    "--text-weight 1": Skip(BENCH),
    "python benchmarks/throughput.py --warmup 2 --steps 8 --threads 1 -- --job.config_file "
    "train_configs/debug_model.toml --model.name qwen3_5 --model.flavor debugmodel "
    "--training.seq_len 512 --training.local_batch_size 4": Skip(BENCH),
    "python benchmarks/throughput.py --ladder --threads 1 --warmup 2 --steps 4 --peak-budget 3 -- "
    "--job.config_file train_configs/debug_model.toml --job.dump_folder /tmp/perf7/bench "
    "--no-quantize.dense.float8.auto_filter_small_kn": Skip(BENCH),
    "python benchmarks/throughput.py --warmup 3 --steps 10 -- --job.config_file "
    "train_configs/debug_model.toml": Skip(BENCH),
    "python benchmarks/throughput.py --ladder -- --job.config_file train_configs/debug_model.toml "
    "--no-quantize.dense.float8.auto_filter_small_kn": Skip(BENCH),
    "python benchmarks/overhead.py --threads 1 --warmup 3 --steps 5 --rounds 8 -- "
    "--job.config_file train_configs/debug_model.toml --job.dump_folder /tmp/perf7/ovh2": Skip(
        BENCH
    ),
    "python benchmarks/throughput.py --ladder --warmup 3 --steps 10 --only qwen3_30b_a3b,"
    "compile+qwen3_30b_a3b,compile+float8_experts+qwen3_30b_a3b -- --job.config_file "
    "train_configs/debug_model.toml --training.seq_len 4096 --training.local_batch_size 2 "
    "--training.mixed_precision_param bfloat16": Skip(GPU),
    "scripts/gpu_check.sh": Skip(GPU),
    "scripts/gpu_check.sh --cpu": Skip(
        "the whole GPU check sequence on CPU: minutes (tests/integration runs it)"
    ),
    "nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv; "
    'python -c "import torch; print(torch.__version__)"': Skip(GPU),
    'COMMON="--job.config_file train_configs/debug_model.toml --model.flavor 1B '
    "--training.seq_len 8192 --training.local_batch_size 1 --training.mixed_precision_param "
    'bfloat16 --metrics.log_freq 10 --job.dump_folder outputs/bench_1b"': Skip(GPU),
    "python benchmarks/throughput.py --ladder --warmup 5 --steps 20 -- $COMMON "
    "| tee gpu_ladder_1b.jsonl": Skip(GPU),
    "python benchmarks/throughput.py --warmup 5 --steps 20 --label compile -- $COMMON "
    "--compile.enable": Skip(GPU),
    "python benchmarks/throughput.py --warmup 5 --steps 20 --label compile+float8_tensorwise -- "
    "$COMMON --compile.enable --quantize.dense.float8.enable": Skip(GPU),
    "python benchmarks/throughput.py --warmup 5 --steps 20 --label compile+float8_rowwise -- "
    "$COMMON --compile.enable --quantize.dense.float8.enable "
    "--quantize.dense.float8.recipe_name rowwise": Skip(GPU),
    "python benchmarks/overhead.py --steps 10 --rounds 8 -- $COMMON --compile.enable": Skip(GPU),
    "python -m torchtitan.train $COMMON --compile.enable --training.steps 20 "
    "--profiling.enable_profiling --profiling.profile_freq 10": Skip(GPU),
    "python benchmarks/startup.py --cases debug,debug_hf,1B_hf": Skip(BENCH),
    "python benchmarks/startup.py --cases debug,1B_hf --code /path/to/main": Skip(PLACEHOLDER),
    # docs/planning.md
    "python -m torchtitan.planner --job.config_file train_configs/llama3_8b.toml --world_size 8 "
    "--device_memory_gib 80 --vocab_size 128256 --top 3": Fast(0, "layouts enumerated"),
    "NGPU=8 CONFIG_FILE=train_configs/llama3_8b.toml ./run_train.sh --parallelism.auto": Skip(
        GPU + " x 8"
    ),
    "python -m torchtitan.config --job.config_file train_configs/debug_model.toml "
    "--parallelism.auto --world_size 2": Fast(0, "parallelism.auto chose"),
    "python benchmarks/planner_vs_measured.py --rounds 2 --warmup 1 --steps 3 --out pvm.json": Skip(
        BENCH
    ),
    "python benchmarks/planner_vs_measured.py --rounds 2 --warmup 1 --steps 3 --out pvm.json "
    "--merge": Skip(BENCH),
    "python benchmarks/planner_vs_measured.py --report pvm.json": Skip(
        "reads the pvm.json the benchmark above writes"
    ),
    "WORLD_SIZE=8 python -m torchtitan.train --job.config_file train_configs/debug_model.toml "
    "--job.explain --parallelism.pipeline_parallel_degree 2 --parallelism.tensor_parallel_degree 2 "
    "--training.global_batch_size 32": Fast(0, "== preflight: llama3 debugmodel"),
    # the shipped configs' "check the layout without GPUs" lines (no --job.fit_check off needed)
    "python -m torchtitan.config --job.config_file train_configs/deepseek_v3_16b.toml "
    "--world_size 8": Fast(),
    "python -m torchtitan.config --job.config_file train_configs/deepseek_v3_671b.toml "
    "--world_size 2048": Fast(),
    "python -m torchtitan.config --job.config_file train_configs/gpt_oss_20b.toml --world_size 8": Fast(),
    "python -m torchtitan.config --job.config_file train_configs/llama3_405b.toml "
    "--world_size 512": Fast(),
    "python -m torchtitan.config --job.config_file train_configs/llama3_70b.toml "
    "--world_size 256": Fast(),
    "python -m torchtitan.config --job.config_file train_configs/llama3_8b.toml --world_size 8": Fast(),
    "python -m torchtitan.config --job.config_file train_configs/qwen3_8b.toml --world_size 8": Fast(),
    # docs/hf_models.md
    "./run_train.sh --job.config_file train_configs/debug_model.toml --model.name hf "
    "--model.flavor train_configs/hf/llama3_debugmodel": Slow(SMALL),
    "./run_train.sh ... --model.name hf --model.flavor /models/Mistral-7B "
    "--checkpoint.initial_load_path /models/Mistral-7B --checkpoint.initial_load_in_hf": Skip(
        "a placeholder path (/models/Mistral-7B)"
    ),
    "python -m torchtitan.convert to-hf outputs/checkpoint/step-1000 hf_out --model hf "
    "--flavor /models/Mistral-7B": Skip("a placeholder path (/models/Mistral-7B)"),
    "python benchmarks/throughput.py --threads 1 --warmup 3 --steps 10 -- --job.config_file "
    "train_configs/debug_model.toml --training.seq_len 256 --training.local_batch_size 4 "
    "--training.mixed_precision_param float32 --model.name llama3 --model.flavor debugmodel": Skip(
        BENCH
    ),
}


def logical_lines(text: str) -> list[str]:
    """Lines with their ``\\`` continuations joined."""
    out: list[str] = []
    cur = ""
    for line in text.splitlines():
        s = line.rstrip()
        if s.endswith("\\"):
            cur += s[:-1].strip() + " "
            continue
        out.append((cur + s.strip()).strip())
        cur = ""
    if cur:
        out.append(cur.strip())
    return out


def strip_comment(line: str) -> str:
    """``line`` without a trailing ``# comment`` (a ``#`` outside quotes, after a blank)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].strip()
    return line.strip()


def program(command: str) -> str:
    """The program a command runs: its first word after ``NAME=value`` assignments."""
    for word in command.split():
        if not _ENV.fullmatch(word):
            return word
    return ""


def commands_in(path: Path) -> list[str]:
    """The commands of a markdown file or of a TOML file's leading comment, in order."""
    text = path.read_text()
    if path.suffix == ".toml":
        head = []
        for line in text.splitlines():
            if not line.startswith("#"):
                break
            head.append(line[1:])
        lines = (strip_comment(x) for x in logical_lines("\n".join(head)))
        return [c for c in lines if program(c) in PROGRAMS]
    found: list[str] = []
    for m in _FENCE.finditer(text):
        lang, body = m.group(1), m.group(2)
        if lang not in ("bash", "sh", "shell", "console", ""):
            continue
        for line in logical_lines(body):
            c = strip_comment(line.removeprefix("$ "))
            if c and (lang != "" or program(c) in PROGRAMS):
                found.append(c)
    return found


def sources() -> list[Path]:
    return [
        ROOT / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "train_configs").glob("*.toml")),
    ]


def normal(command: str) -> str:
    """A command with its runs of blanks made one (the table's key)."""
    return " ".join(command.split())


def all_commands() -> dict[str, list[str]]:
    """Each command (normalised) -> the files it appears in, in first-seen order."""
    found: dict[str, list[str]] = {}
    for path in sources():
        for c in commands_in(path):
            found.setdefault(normal(c), []).append(str(path.relative_to(ROOT)))
    return found
