"""Preflight rules of the post-training modes (``training.mode = "dpo" | "grpo"``; the
``[dpo]`` and ``[grpo]`` sections; docs/posttrain.md). Before any process group: a section's
fields set while another mode runs are refused (they would be ignored), as are the language-model
data fields and the layouts and features the modes do not support; the data file is read with the
run's tokenizer as the trainer will read it (empty chosen/rejected sides, prompts that leave no
room in ``training.seq_len``: the error names the file and line)."""

from __future__ import annotations

import dataclasses
from typing import Any

from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig, Training
from torchtitan.config.sections import Dpo, Grpo
from torchtitan.data.tokenizer import build_tokenizer
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.posttrain.dpo import DpoSettings, check_settings
from torchtitan.posttrain.grpo import read_prompts
from torchtitan.posttrain.preference_data import PreferenceDataset
from torchtitan.posttrain.rewards import resolve
from torchtitan.tools.paths import resolve_repo_path

# training fields that choose language-model data: the post-training modes read their own file
_LM_DATA = (
    "dataset",
    "dataset_path",
    "data_sharding",
    "document_positions",
    "tokenized_shuffle",
    "mixture",
    "mixture_exhausted",
)


def validate_mode_fields(cfg: JobConfig) -> None:
    """Fields the mode would ignore (run before the data checks, which would read them):
    ``[dpo]``/``[grpo]`` of another mode, the language-model data of a post-training mode."""
    mode = cfg.training.mode
    for name, cls in (("dpo", Dpo), ("grpo", Grpo)):
        if mode != name:
            _refuse_set_fields(cfg, name, cls, f"applies only to training.mode = '{name}'")
    if mode != "lm":
        _refuse_set_fields(cfg, "training", Training,
                           f"is language-model data, unused by '{mode}'", _LM_DATA)  # fmt: skip


def validate_posttrain(cfg: JobConfig, dims: ParallelDims) -> None:
    """Raise ConfigError on the first broken rule of a post-training mode: layout, features,
    settings, its data file."""
    if cfg.training.mode == "lm":
        return
    _refuse_unsupported(cfg, dims)
    if cfg.training.mode == "dpo":
        _validate_dpo(cfg)
    else:
        _validate_grpo(cfg, dims)


def _refuse_set_fields(
    cfg: JobConfig, section: str, cls: type, rule: str, only: tuple[str, ...] | None = None
) -> None:
    """A field of ``section`` that differs from its default is refused with ``rule``."""
    default = cls()
    for f in dataclasses.fields(cls):
        if only is not None and f.name not in only:
            continue
        value = getattr(getattr(cfg, section), f.name)
        if value != getattr(default, f.name):
            raise ConfigError(
                f"{section}.{f.name}",
                value,
                f"{rule} (training.mode = '{cfg.training.mode}')",
                "remove it, or set training.mode to the mode it belongs to (docs/posttrain.md)",
            )


def _refuse_unsupported(cfg: JobConfig, dims: ParallelDims) -> None:
    mode, t = cfg.training.mode, cfg.training
    refused: list[tuple[str, Any, str, str]] = [
        ("parallelism.pipeline_parallel_degree", dims.pp, "pipeline parallel", "set it to 1"),
        ("parallelism.context_parallel_degree", dims.cp, "context parallel", "set it to 1"),
    ]
    if mode == "grpo":  # the generator: data-parallel layouts only (posttrain/rollout.py)
        refused.append(
            ("parallelism.tensor_parallel_degree", dims.tp, "generation under TP", "set it to 1")
        )
    for field, value, what, fix in refused:
        if value > 1:
            raise ConfigError(
                field, value, f"training.mode = '{mode}' does not support {what}", fix
            )
    for field, value, default, why in (
        ("training.spike_policy", t.spike_policy, "off", "its loss is not a language-model loss"),
        ("training.loss_chunk_size", t.loss_chunk_size, 0, "it needs the model's logits"),
        ("model.attn_mask_type", cfg.model.attn_mask_type, "causal", "its rows are padded, not packed"),
        ("compile.enable", cfg.compile.enable if mode == "grpo" else False, False,
         "the KV-cache generator runs the model eagerly"),
    ):  # fmt: skip
        if value != default:
            raise ConfigError(
                field,
                value,
                f"not supported with training.mode = '{mode}': {why}",
                f"set it to {default!r} (docs/posttrain.md)",
            )


def _data_file(field: str, path: str, what: str) -> str:
    if not path:
        raise ConfigError(field, path, f"training.mode needs {what}", f"set --{field}")
    file = resolve_repo_path(path)
    if not file.exists():
        raise ConfigError(
            field,
            path,
            "does not exist (looked in the working directory and the repository root)",
            f"point it at {what} (scripts/make_posttrain_data.py writes examples)",
        )
    return str(file)


def _validate_dpo(cfg: JobConfig) -> None:
    d, lora = cfg.dpo, cfg.lora.enable
    settings = DpoSettings(d.loss_type, d.beta, d.label_smoothing, d.simpo_gamma)
    if (problem := check_settings(settings)) is not None:
        field = problem.split(" ", 1)[0]
        raise ConfigError(field, None, problem, "use a value in range (docs/posttrain.md)")
    if d.loss_type == "simpo" and d.reference != "auto":
        raise ConfigError("dpo.reference", d.reference, "simpo uses no reference", "remove it")
    if d.loss_type != "simpo" and d.simpo_gamma != Dpo().simpo_gamma:
        raise ConfigError(
            "dpo.simpo_gamma", d.simpo_gamma, "applies to loss_type 'simpo' only", "remove it"
        )
    if d.reference == "adapters_off" and not lora:
        raise ConfigError(
            "dpo.reference",
            d.reference,
            "the adapters-off reference needs LoRA adapters, and lora.enable is off",
            "use 'frozen_copy' or 'auto', or turn on lora.enable",
        )
    path = _data_file("dpo.dataset_path", d.dataset_path, "a JSONL file of preference pairs")
    tokenizer = build_tokenizer(cfg.model.tokenizer_path)
    PreferenceDataset(path, tokenizer, cfg.training.seq_len)  # DataError naming file and record


def _validate_grpo(cfg: JobConfig, dims: ParallelDims) -> None:
    g = cfg.grpo
    if g.k < 2:
        raise ConfigError(
            "grpo.k",
            g.k,
            "must be >= 2: advantages are rewards minus their group's mean, so with one "
            "completion per prompt every advantage is 0 and nothing is learned",
            "sample at least 2 completions per prompt, e.g. 4",
        )
    if g.prompts_per_step < 1 or g.prompts_per_step % dims.dp_degree:
        raise ConfigError(
            "grpo.prompts_per_step",
            g.prompts_per_step,
            f"must be a positive multiple of the data-parallel degree {dims.dp_degree}",
            f"use e.g. {dims.dp_degree * max(1, g.prompts_per_step // dims.dp_degree)}",
        )
    # max_new_tokens, temperature, top_k, the clip epsilons and kl_coef: their ranges are
    # validate_values.RULES, checked before this.
    _validate_rewards(g)
    path = _data_file("grpo.prompts_path", g.prompts_path, 'a JSONL file of {"prompt", "answer"}')
    tokenizer = build_tokenizer(cfg.model.tokenizer_path)
    try:
        prompts = read_prompts(path, tokenizer, cfg.training.seq_len, g.max_new_tokens)
    except (ValueError, KeyError, TypeError) as e:  # json.JSONDecodeError is a ValueError
        rule = f"a record has no {e}" if isinstance(e, KeyError) else str(e)
        raise ConfigError("grpo.prompts_path", g.prompts_path, rule, "fix the file") from None
    if not prompts:
        raise ConfigError("grpo.prompts_path", g.prompts_path, "holds no prompt", "add records")
    if "exact_match" in g.rewards and any(answer is None for _, answer in prompts):
        raise ConfigError(
            "grpo.prompts_path",
            g.prompts_path,
            "a record has no 'answer', which the exact_match reward needs",
            "add an answer to every record, or drop exact_match from grpo.rewards",
        )


def _validate_rewards(g: Grpo) -> None:
    if not g.rewards:
        raise ConfigError(
            "grpo.rewards", g.rewards, "needs a reward function", 'e.g. ["exact_match"]'
        )
    for name in g.rewards:
        try:
            resolve(name)
        except ValueError as e:
            raise ConfigError("grpo.rewards", name, str(e), "fix the name or the module") from None
    if g.reward_weights and len(g.reward_weights) != len(g.rewards):
        raise ConfigError(
            "grpo.reward_weights",
            g.reward_weights,
            f"gives {len(g.reward_weights)} weights for {len(g.rewards)} reward functions",
            "give one weight per function, or none (each 1.0)",
        )
