"""``python -m torchtitan.eval --job.config_file F --eval.tasks A,B [--eval.checkpoint PATH]``:
lm-eval tasks on a checkpoint (docs/evaluation.md).

Under ``torchrun --nproc_per_node N`` the ranks form ``N / tp`` data-parallel replicas of
``parallelism.tensor_parallel_degree`` ranks each: requests are split over the replicas, the
model over each replica's ranks. The config is validated first, tasks included (unknown names,
missing local files, Hub data while offline: one line, exit 2). Scores go to the log and the
metric writers of ``[metrics]`` at the checkpoint's step; lm-eval's full result dict to
``<dump_folder>/eval/results_step-N.json`` (rank 0).
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from torchtitan.checkpoint import storage as io
from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig
from torchtitan.config.manager import asked_for_help
from torchtitan.preflight.validate import load_config
from torchtitan.preflight.validate_eval import validate_eval
from torchtitan.preflight.validate_weights import validate_eval_checkpoint

if TYPE_CHECKING:
    from torchtitan.eval.harness import Evaluator


def checkpoint_path(cfg: JobConfig) -> Path:
    """``eval.checkpoint``, or the checkpoint folder of the run in ``job.dump_folder``."""
    if cfg.eval.checkpoint:
        return Path(cfg.eval.checkpoint)
    return Path(cfg.job.dump_folder) / cfg.checkpoint.folder


def evaluate(cfg: JobConfig, log_samples: bool = False) -> Evaluator:
    """Load, split, evaluate, report; returns the evaluator (``last_results``: lm-eval's result
    dict, the same on every rank; with ``log_samples`` it holds every request's answer)."""
    # Imported here, after the config and the checkpoint were validated: a config error
    # appears in the time it takes to import torch (docs/evaluation.md).
    from torchtitan.data.tokenizer import build_tokenizer
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.eval.harness import Evaluator, make_lm
    from torchtitan.eval.loading import checkpoint_args, load_eval_model
    from torchtitan.metrics.writers import build_job_writers
    from torchtitan.tools.logging import init_logger, logger

    device, world, rank = dist_utils.init_distributed(cfg.comm.init_timeout_seconds)
    tp = cfg.parallelism.tensor_parallel_degree
    dims = ParallelDims(dp_replicate=world // tp, dp_shard=1, cp=1, tp=tp, pp=1, world_size=world)
    dims.build_mesh(device.type)
    init_logger(prefix=f"[{dims.describe_rank(rank)}] ")
    tokenizer = build_tokenizer(cfg.model.tokenizer_path)
    path = checkpoint_path(cfg)
    hf = (path / "config.json").is_file()
    if not hf and not (path / ".metadata").is_file():  # a checkpoint root: its newest step
        found = io.find_checkpoint(path, skip_exports=False)
        path = found.path if found is not None else path
    trust = cfg.model.hf_trust_remote_code
    family, args = checkpoint_args(path, hf, cfg.model.name, cfg.model.flavor, trust)
    if not hf:  # the trainer's RoPE table covers training.seq_len
        args = dataclasses.replace(args, max_seq_len=cfg.training.seq_len)
    if tokenizer.vocab_size > args.vocab_size:
        raise ConfigError(
            "model.tokenizer_path",
            cfg.model.tokenizer_path,
            f"has {tokenizer.vocab_size} tokens, the checkpoint's model only {args.vocab_size}",
            "use the tokenizer the checkpoint was trained with",
        )
    dtype = dist_utils.resolve_dtype(cfg.training.mixed_precision_param, device.type)
    model = load_eval_model(path, hf, family, args, dims, cfg, device, dtype)
    dp = dims.get_mesh("dp")
    lm = make_lm(
        model,
        tokenizer,
        args.max_seq_len,
        device,
        cfg.eval,
        (dp.get_group(), dp.get_local_rank(), dp.size()),
    )
    writers = build_job_writers(cfg, rank, write_this_rank=rank == 0)
    named = re.search(r"step-(\d+)", str(path.resolve()))
    step = int(named.group(1)) if named else 0
    evaluator = Evaluator(lm, cfg.eval, writers, seed=cfg.debug.seed)
    logger.info(f"evaluating {path} ({family}, {'HF' if hf else 'DCP'}) on {cfg.eval.tasks}")
    evaluator.evaluate(step, log_samples=log_samples)
    if rank == 0:
        out = Path(cfg.job.dump_folder) / "eval" / f"results_step-{step}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(evaluator.last_results, indent=1, default=str))
    for w in writers:
        w.close()
    return evaluator


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if asked_for_help(argv):
        return 0
    try:
        cfg = load_config(argv)
        # the checkpoint before the tasks (resolving them indexes lm-eval's task folders)
        validate_eval_checkpoint(cfg, checkpoint_path(cfg))
        validate_eval(cfg, standalone=True)
        evaluate(cfg)
    except ConfigError as e:  # one line, exit 2 (docs/errors.md)
        print(f"config error: {e}", file=sys.stderr)
        return 2
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
