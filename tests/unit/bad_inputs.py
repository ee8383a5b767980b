"""The bad inputs of docs/errors.md "Common errors": (id, argv, field, words of the message).

``{d}`` in an argument is replaced by a folder of bad files made by :func:`make_bad_files`.
``python -m tests.unit.bad_inputs`` prints the docs table (run it after changing a message).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

CONFIG = ["--job.config_file", "train_configs/debug_model.toml"]

# (id, argv after CONFIG, world size, field, words the message must hold)
CASES: list[tuple[str, list[str], int, str, str]] = [
    # the command line
    (
        "unknown-no-field-eq",
        ["--training.no_such_field=3"],
        1,
        "training.no_such_field",
        "is not a field of [training]",
    ),
    (
        "unknown-no-field-space",
        ["--training.no_such_field", "3"],
        1,
        "training.no_such_field",
        "is not a field of [training]",
    ),
    ("unknown-section", ["--trainin.steps", "3"], 1, "trainin", "did you mean 'training'"),
    (
        "field-in-other-section",
        ["--training.lr", "1e-3"],
        1,
        "training.lr",
        "did you mean 'optimizer.lr'",
    ),
    ("typo-field", ["--optimizer.beta_1", "0.9"], 1, "optimizer.beta_1", "did you mean 'beta1'"),
    (
        "negated-non-bool",
        ["--no-training.steps"],
        1,
        "training.steps",
        "--no- only applies to boolean fields",
    ),
    ("positional", ["steps=3"], 1, "<command line>", "is not an option"),
    ("missing-value", ["--training.steps"], 1, "training.steps", "needs a value"),
    ("int-not-int", ["--training.steps", "3.5"], 1, "training.steps", "must be an integer"),
    ("bool-not-bool", ["--compile.enable", "maybe"], 1, "compile.enable", "must be a boolean"),
    (
        "choice",
        ["--optimizer.name", "SGD"],
        1,
        "optimizer.name",
        "must be one of ['AdamW', 'Adam', 'Muon']",
    ),
    ("section-as-field", ["--training", "3"], 1, "training", "is a section, not a field"),
    # optimizer groups and Muon (docs/optimizers.md)
    ("groups-cli", ["--optimizer.groups", "x"], 1, "optimizer.groups", "is a list of tables"),
    (
        "groups-cli-index",
        ["--optimizer.groups.0.lr_mult", "2"],
        1,
        "optimizer.groups.0",
        "names no table of optimizer.groups",
    ),
    (
        "groups-no-match",
        ["--job.config_file", "{d}/groups.toml"],
        1,
        "optimizer.groups[0]",
        "matches no parameter",
    ),
    (
        "groups-effective-lr",
        ["--job.config_file", "{d}/groups_lr.toml"],
        1,
        "optimizer.groups[0].lr_mult",
        "= 2000, above 1 (the bound of optimizer.lr holds for every group)",
    ),
    (
        "groups-unknown-kind",
        ["--job.config_file", "{d}/groups_kind.toml"],
        1,
        "optimizer.groups[0].kinds",
        "use kinds from ['matrix', 'embedding', 'output', 'norm', 'bias', 'router', 'experts'",
    ),
    (
        "muon-momentum-1",
        ["--optimizer.muon_momentum", "1"],
        1,
        "optimizer.muon_momentum",
        "must be in [0, 1)",
    ),
    (
        "muon-ns-steps-0",
        ["--optimizer.muon_ns_steps", "0"],
        1,
        "optimizer.muon_ns_steps",
        "in [1, 99]",
    ),
    (
        "muon-bf16-moments",
        ["--optimizer.name", "Muon", "--optimizer.moments_dtype", "bfloat16"],
        1,
        "optimizer.moments_dtype",
        "Muon's AdamW groups use torch's AdamW",
    ),
    # numbers
    ("lr-nan", ["--optimizer.lr", "nan"], 1, "optimizer.lr", "must be a finite number in (0, 1]"),
    ("lr-inf", ["--optimizer.lr", "inf"], 1, "optimizer.lr", "must be a finite number in (0, 1]"),
    ("lr-zero", ["--optimizer.lr", "0"], 1, "optimizer.lr", "must be in (0, 1]"),
    ("lr-huge", ["--optimizer.lr", "5"], 1, "optimizer.lr", "must be in (0, 1]"),
    ("beta1-1.5", ["--optimizer.beta1", "1.5"], 1, "optimizer.beta1", "must be in [0, 1)"),
    ("beta2-1", ["--optimizer.beta2", "1"], 1, "optimizer.beta2", "must be in [0, 1)"),
    ("eps-zero", ["--optimizer.eps", "0"], 1, "optimizer.eps", "must be in (0, 1]"),
    (
        "weight-decay-neg",
        ["--optimizer.weight_decay", "-0.1"],
        1,
        "optimizer.weight_decay",
        "must be >= 0",
    ),
    (
        "max-norm-nan",
        ["--training.max_norm", "nan"],
        1,
        "training.max_norm",
        "must be a finite number",
    ),
    (
        "max-norm-inf",
        ["--training.max_norm", "inf"],
        1,
        "training.max_norm",
        "or 0 to turn clipping off",
    ),
    ("steps-zero", ["--training.steps", "0"], 1, "training.steps", "must be >= 1"),
    ("seq-len-neg", ["--training.seq_len", "-1"], 1, "training.seq_len", "must be >= 1"),
    (
        "local-batch-zero",
        ["--training.local_batch_size", "0"],
        1,
        "training.local_batch_size",
        "must be >= 1",
    ),
    (
        "global-batch-zero",
        ["--training.global_batch_size", "0"],
        1,
        "training.global_batch_size",
        "must be >= 1 or -1",
    ),
    ("gc-freq-neg", ["--training.gc_freq", "-1"], 1, "training.gc_freq", "must be >= 0"),
    (
        "warmup-neg",
        ["--lr_scheduler.warmup_steps", "-5"],
        1,
        "lr_scheduler.warmup_steps",
        "must be >= 0",
    ),
    (
        "decay-ratio",
        ["--lr_scheduler.decay_ratio", "1.5"],
        1,
        "lr_scheduler.decay_ratio",
        "must be in [0, 1]",
    ),
    (
        "min-lr-nan",
        ["--lr_scheduler.min_lr_factor", "nan"],
        1,
        "lr_scheduler.min_lr_factor",
        "must be a finite number in [0, 1]",
    ),
    (
        "ckpt-interval-zero",
        ["--checkpoint.interval", "0"],
        1,
        "checkpoint.interval",
        "must be >= 1",
    ),
    (
        "keep-latest-neg",
        ["--checkpoint.keep_latest_k", "-1"],
        1,
        "checkpoint.keep_latest_k",
        "must be >= 0",
    ),
    (
        "load-step-neg",
        ["--checkpoint.load_step", "-3"],
        1,
        "checkpoint.load_step",
        "must be >= 0 or -1",
    ),
    ("log-freq-zero", ["--metrics.log_freq", "0"], 1, "metrics.log_freq", "must be >= 1"),
    (
        "leak-window",
        ["--metrics.memory_leak_window", "5"],
        1,
        "metrics.memory_leak_window",
        "must be >= 8 or 0",
    ),
    (
        "leak-growth-inf",
        ["--metrics.memory_leak_min_growth_mib", "inf"],
        1,
        "metrics.memory_leak_min_growth_mib",
        "must be a finite number > 0",
    ),
    (
        "timeout-zero",
        ["--comm.train_timeout_seconds", "0"],
        1,
        "comm.train_timeout_seconds",
        "must be >= 1",
    ),
    ("seed-neg", ["--debug.seed", "-1"], 1, "debug.seed", "must be in [0, 9223372036854775807]"),
    (
        "dp-shard-zero",
        ["--parallelism.data_parallel_shard_degree", "0"],
        1,
        "parallelism.data_parallel_shard_degree",
        "must be >= 1 or -1",
    ),
    ("validation-freq-zero", ["--validation.freq", "0"], 1, "validation.freq", "must be >= 1"),
    (
        "profile-freq-zero",
        ["--profiling.profile_freq", "0"],
        1,
        "profiling.profile_freq",
        "must be >= 1",
    ),
    # cross-field
    (
        "tp-3-on-2-ranks",
        ["--parallelism.tensor_parallel_degree", "3"],
        2,
        "parallelism.tensor_parallel_degree",
        "2 ranks cannot hold tp=3",
    ),
    ("flavor", ["--model.flavor", "huge"], 1, "model.flavor", "is not a flavor of llama3"),
    # paths
    (
        "dump-folder-file",
        ["--job.dump_folder", "{d}/a_file"],
        1,
        "job.dump_folder",
        "is a regular file, not a folder",
    ),
    (
        "dump-folder-under-file",
        ["--job.dump_folder", "{d}/a_file/out"],
        1,
        "job.dump_folder",
        "is under <dir>/a_file, a file, not a folder",
    ),
    (
        "tb-folder-is-file",
        ["--metrics.save_tb_folder", "{d}/a_file"],
        1,
        "metrics.save_tb_folder",
        "a_file is a regular file, not a folder",
    ),
    (
        "checkpoint-folder-under-file",
        ["--checkpoint.folder", "{d}/a_file/ck"],
        1,
        "checkpoint.folder",
        "is under <dir>/a_file, a file",
    ),
    ("dump-folder-empty", ["--job.dump_folder", ""], 1, "job.dump_folder", "must not be empty"),
    (
        "tokenizer-missing",
        ["--model.tokenizer_path", "{d}/missing"],
        1,
        "model.tokenizer_path",
        "does not exist",
    ),
    (
        "tokenizer-corrupt",
        ["--model.tokenizer_path", "{d}/corrupt.model"],
        1,
        "model.tokenizer_path",
        "is not a tiktoken ranks file",
    ),
    (
        "dataset-path-missing",
        ["--training.dataset_path", "{d}/missing.jsonl"],
        1,
        "training.dataset_path",
        "does not exist",
    ),
    (
        "dataset-empty-file",
        ["--training.dataset_path", "{d}/empty.jsonl"],
        1,
        "training.dataset_path",
        "empty.jsonl: is empty",
    ),
    (
        "dataset-blank-lines",
        ["--training.dataset_path", "{d}/blank.jsonl"],
        1,
        "training.dataset_path",
        "blank.jsonl: holds no records",
    ),
    (
        "dataset-invalid-json",
        ["--training.dataset_path", "{d}/bad.jsonl"],
        1,
        "training.dataset_path",
        "bad.jsonl, line 3: the record is not a JSON object",
    ),
    (
        "dataset-no-text-column",
        ["--training.dataset_path", "{d}/notext.jsonl"],
        1,
        "training.dataset_path",
        "notext.jsonl, line 1: the record has no 'text' field (fields: ['body'])",
    ),
    (
        "dataset-not-utf8",
        ["--training.dataset_path", "{d}/latin1.txt"],
        1,
        "training.dataset_path",
        "latin1.txt, line 3: is not UTF-8 text",
    ),
    (
        "dataset-no-split-files",
        ["--training.dataset_path", "{d}/nodata"],
        1,
        "training.dataset_path",
        "no data files for split 'train'",
    ),
    (
        "dataset-path-like-name",
        ["--training.dataset", "./nope.jsonl"],
        1,
        "training.dataset",
        "looks like a local path but does not exist",
    ),
    (
        "validation-dataset-missing",
        ["--validation.enable", "--validation.dataset_path", "{d}/missing"],
        1,
        "validation.dataset_path",
        "does not exist",
    ),
    (
        "validation-dataset-bad-record",
        ["--validation.enable", "--validation.dataset_path", "{d}/bad.jsonl"],
        1,
        "validation.dataset_path",
        "bad.jsonl, line 3: the record is not a JSON object",
    ),
    (
        "validation-dataset-no-split-files",
        ["--validation.enable", "--validation.dataset_path", "{d}/trainonly"],
        1,
        "validation.dataset_path",
        "no data files for split 'validation'",
    ),
    (
        "validation-corpus-no-manifest",
        [
            "--validation.enable",
            "--validation.dataset",
            "tokenized",
            "--validation.dataset_path",
            "{d}/trainonly",
        ],
        1,
        "validation.dataset_path",
        "manifest.json",
    ),
    (
        "mixture-source-bad-record",
        ["--job.config_file", "train_configs/debug_model.toml,{d}/mixture_bad.toml"],
        1,
        "training.mixture[1].path",
        "bad.jsonl, line 3: the record is not a JSON object",
    ),
    (
        "mixture-source-no-split-files",
        ["--job.config_file", "train_configs/debug_model.toml,{d}/mixture_nodata.toml"],
        1,
        "training.mixture[0].path",
        "no data files for split 'train'",
    ),
    (
        "eval-unknown-task",
        ["--eval.freq", "10", "--eval.tasks", "no_such_task"],
        1,
        "eval.tasks",
        "is no task, group or tag",
    ),
    ("eval-freq-negative", ["--eval.freq", "-5"], 1, "eval.freq", "must be >= 0"),
    (
        "load-step-999",
        ["--job.dump_folder", "{d}/run", "--checkpoint.enable", "--checkpoint.load_step", "999"],
        1,
        "checkpoint.load_step",
        "holds no complete step-999 checkpoint",
    ),
    (
        "initial-load-missing",
        ["--checkpoint.initial_load_path", "{d}/missing"],
        1,
        "checkpoint.initial_load_path",
        "is not a folder",
    ),
    (
        "mtp-without-mtp-family",
        ["--model.mtp_depth", "1"],
        1,
        "model.mtp_depth",
        "llama3 has no multi-token prediction",
    ),
    (
        "mtp-loss-weight-huge",
        ["--model.name", "deepseek_v3", "--model.mtp_loss_weight", "1e9"],
        1,
        "model.mtp_loss_weight",
        "must be in [0, 1] or -1",
    ),
    (
        "mtp-depth-above-seq-len",
        ["--model.name", "deepseek_v3", "--model.mtp_depth", "100000"],
        1,
        "model.mtp_depth",
        "must be at most training.seq_len - 2 = 510",
    ),
    (
        "mtp-with-chunked-loss",
        ["--model.name", "deepseek_v3", "--training.loss_chunk_size", "64"],
        1,
        "training.loss_chunk_size",
        "the chunked loss does not take the multi-token-prediction losses",
    ),
    (
        "config-file-missing",
        ["--job.config_file", "{d}/missing.toml"],
        1,
        "job.config_file",
        "must be an existing TOML file",
    ),
    (
        "config-file-syntax",
        ["--job.config_file", "{d}/broken.toml"],
        1,
        "job.config_file",
        "is not valid TOML",
    ),
    # composition (docs/configs.md)
    (
        "extends-cycle",
        ["--job.config_file", "{d}/cycle_a.toml"],
        1,
        "extends",
        "the chain is a cycle",
    ),
    ("extends-missing", ["--job.config_file", "{d}/orphan.toml"], 1, "extends", "does not exist"),
    (
        "extends-folder",
        ["--job.config_file", "{d}/extends_folder.toml"],
        1,
        "extends",
        "nodata is a folder, not a TOML file",
    ),
    (
        "config-file-folder",
        ["--job.config_file", "{d}/nodata"],
        1,
        "job.config_file",
        "is a folder, not a TOML file",
    ),
    (
        "overlay-unknown-key",
        ["--job.config_file", "train_configs/debug_model.toml,{d}/typo.toml"],
        1,
        "training.stepz",
        "is not a field of [training] (in",
    ),
    (
        "config-file-utf16",
        ["--job.config_file", "{d}/utf16.toml"],
        1,
        "job.config_file",
        "is not UTF-8 text",
    ),
    (
        "fit-check-choice",
        ["--job.fit_check", "maybe"],
        1,
        "job.fit_check",
        "must be one of ['error', 'warn', 'off']",
    ),
    # LoRA (docs/lora.md)
    ("lora-rank-zero", ["--lora.enable", "--lora.rank", "0"], 1, "lora.rank", "must be"),
    (
        "lora-target-none",
        ["--lora.enable", "--lora.target_modules", "no_such_module"],
        1,
        "lora.target_modules",
        "match no module of the model",
    ),
    (
        "lora-target-experts-dense",
        ["--lora.enable", "--lora.target_modules", "feed_forward.experts"],
        1,
        "lora.target_modules",
        "Fix: use some of attention.wq,attention.wk,attention.wv,attention.wo,feed_forward.w1,",
    ),
    (
        "lora-rank-above-width",
        ["--lora.enable", "--lora.rank", "100000"],
        1,
        "lora.rank",
        "must be at most the smaller side of every adapted projection",
    ),
    (
        "qlora-without-lora",
        ["--lora.quantize_base", "nf4"],
        1,
        "lora.quantize_base",
        "needs lora.enable = true",
    ),
    (
        "lora-adapter-without-lora",
        ["--lora.adapter_path", "{d}/trainonly"],
        1,
        "lora.adapter_path",
        "needs lora.enable = true",
    ),
    (
        "lora-target-norm",
        ["--lora.enable", "--lora.target_modules", "attention_norm"],
        1,
        "lora.target_modules",
        "adapters wrap nn.Linear projections",
    ),
    (
        "qlora-tp",
        [
            "--lora.enable",
            "--lora.quantize_base",
            "nf4",
            "--parallelism.tensor_parallel_degree",
            "2",
        ],
        2,
        "parallelism.tensor_parallel_degree",
        "runs under FSDP (dp_shard) and PP only",
    ),
    (
        "lora-adapter-path-missing",
        ["--lora.enable", "--lora.adapter_path", "{d}/missing"],
        1,
        "lora.adapter_path",
        "must be a PEFT folder holding adapter_config.json",
    ),
    (
        "lora-float8",
        ["--lora.enable", "--quantize.dense.float8.enable"],
        1,
        "lora.enable",
        "adapters are not built on float8 linears",
    ),
    # replica fault tolerance with torchft (docs/fault_tolerance.md)
    (
        "ft-one-group",
        ["--fault_tolerance.enable"],
        1,
        "fault_tolerance.group_size",
        "fault tolerance needs at least 2 replica groups",
    ),
    (
        "ft-dp-replicate",
        [
            "--fault_tolerance.enable",
            "--fault_tolerance.group_size",
            "2",
            "--parallelism.data_parallel_replicate_degree",
            "2",
        ],
        2,
        "parallelism.data_parallel_replicate_degree",
        "the replicas are the separate replica-group jobs",
    ),
    (
        "ft-replica-id",
        ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2"]
        + ["--fault_tolerance.replica_id", "2"],
        1,
        "fault_tolerance.replica_id",
        "must be in 0..1",
    ),
    (
        "ft-lighthouse-down",
        ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2"]
        + ["--fault_tolerance.lighthouse", "http://localhost:9"]
        + ["--fault_tolerance.connect_timeout_seconds", "1"],
        1,
        "fault_tolerance.lighthouse",
        "no torchft lighthouse answers there within 1 s. Fix: start one with `torchft_lighthouse",
    ),
    (
        "ft-diloco-interval-0",
        ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2"]
        + ["--fault_tolerance.semi_sync", "diloco", "--fault_tolerance.sync_every", "0"],
        1,
        "fault_tolerance.sync_every",
        "must be an integer >= 1",
    ),
    (
        "ft-semi-sync-without-ft",
        ["--fault_tolerance.semi_sync", "local_sgd"],
        1,
        "fault_tolerance.semi_sync",
        "semi-synchronous training syncs torchft replica groups",
    ),
    (
        "ft-outer-lr-without-diloco",
        ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2"]
        + ["--fault_tolerance.semi_sync", "local_sgd", "--fault_tolerance.outer_lr", "0.7"],
        1,
        "fault_tolerance.outer_lr",
        "DiLoCo's outer optimizer is used only with semi_sync diloco",
    ),
]


def make_bad_files(d: Path) -> None:
    (d / "a_file").write_text("x")
    (d / "corrupt.model").write_text("this is not base64 !!\n")
    (d / "empty.jsonl").write_text("")
    (d / "blank.jsonl").write_text("\n\n  \n")
    good = json.dumps({"text": "hello"})
    (d / "bad.jsonl").write_text(f"{good}\n{good}\n{{'text': oops}}\n")
    (d / "notext.jsonl").write_text(json.dumps({"body": "hello"}) + "\n")
    (d / "latin1.txt").write_bytes(b"hello world\n\ncaf\xe9 au lait\n")
    (d / "nodata").mkdir()
    (d / "nodata" / "validation.jsonl").write_text(good + "\n")
    (d / "trainonly").mkdir()
    (d / "trainonly" / "train.jsonl").write_text(good + "\n")
    (d / "broken.toml").write_text("[training\nsteps = 3\n")
    mixture = '[training]\ndataset = "mixture"\n'
    source = '[[training.mixture]]\npath = "{}"\nweight = 1.0\n'
    (d / "mixture_bad.toml").write_text(
        mixture + source.format("tests/assets/test_corpus") + source.format(d / "bad.jsonl")
    )
    (d / "mixture_nodata.toml").write_text(mixture + source.format(d / "nodata"))
    debug = (Path(__file__).resolve().parents[2] / CONFIG[1]).read_text()
    groups = '\n[[optimizer.groups]]\nnames = ["layers.*.attn.*"]\nlr_mult = 0.5\n'
    (d / "groups.toml").write_text(debug + groups)
    big = '\n[[optimizer.groups]]\nkinds = ["matrix"]\nlr_mult = 1000000.0\n'
    (d / "groups_lr.toml").write_text(debug + big)  # 2e-3 x 1e6 = 2000
    (d / "groups_kind.toml").write_text(debug + '\n[[optimizer.groups]]\nkinds = ["weights"]\n')
    (d / "extends_folder.toml").write_text('extends = "nodata"\n')
    (d / "cycle_a.toml").write_text('extends = "cycle_b.toml"\n')
    (d / "cycle_b.toml").write_text('extends = "cycle_a.toml"\n')
    (d / "orphan.toml").write_text('extends = "no_such_base.toml"\n')
    (d / "typo.toml").write_text("[training]\nstepz = 3\n")
    (d / "utf16.toml").write_bytes("[training]\nsteps = 3\n".encode("utf-16"))


def argv_of(args: list[str], d: Path) -> list[str]:
    config = [] if "--job.config_file" in args else CONFIG
    return config + [a.replace("{d}", str(d)) for a in args]


def table() -> str:
    """The docs table: each case's arguments and the message it gets."""
    from torchtitan.config.errors import ConfigError
    from torchtitan.preflight.validate import load_config

    rows = ["| input | message |", "| --- | --- |"]
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        make_bad_files(d)
        for _id, args, world, _field, _words in CASES:
            try:
                load_config(argv_of(args, d), world_size=world)
                msg = "(accepted!)"
            except ConfigError as e:
                msg = str(e).replace(str(d), "<dir>")
            shown = " ".join(args).replace("{d}", "<dir>").replace("|", "\\|")
            prefix = f"`NGPU={world}` " if world != 1 else ""
            rows.append(f"| {prefix}`{shown}` | {msg.replace('|', chr(92) + '|')} |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.stdout.write(table() + "\n")
