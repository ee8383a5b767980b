"""Weight folders checked against a model before any process group (docs/errors.md, "Weight
folders"): a Hugging Face folder's ``config.json`` (a family we train, readable, the run's
shape) and tensors (every name the model reads, with its shape), a DCP folder's model tensors
(the family and flavor it was trained as), a PEFT adapter folder (config, weights, rank).
Used by training (``checkpoint.initial_load_path``, ``lora.adapter_path``), ``python -m
torchtitan.eval`` and ``python -m torchtitan.convert``. The file-level checks are
``checkpoint/input_checks.py``; here the family's args and adapter give the expected shapes.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import torch

from torchtitan.checkpoint import storage as io
from torchtitan.checkpoint.input_checks import (
    check_dcp_folder,
    check_hf_tensors,
    dcp_model_shapes,
    expected_hf_shapes,
    read_json,
    safetensors_shapes,
)
from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig
from torchtitan.models import MODELS, family_for_hf_config, flavor_of, run_args

__all__ = [
    "by_own_config",
    "check_hf_files",
    "check_dcp_model",
    "check_hf_model",
    "hf_family",
    "meta_shapes",
    "validate_eval_checkpoint",
    "validate_hf_family",
    "validate_initial_load",
    "validate_peft_folder",
]

_COUNTS = ("dim", "n_layers", "n_heads", "vocab_size")  # DecoderArgsBase's sizes: whole, >= 1
_HF_FIX = "point it at a Hugging Face model folder (config.json + *.safetensors) written by "
_HF_FIX += "transformers' save_pretrained or python -m torchtitan.convert to-hf"


def by_own_config(name: str) -> bool:
    """Whether the model ``name`` is built from each folder's own ``config.json`` (the ``hf``
    family, docs/hf_models.md): its folders get the file checks only."""
    return name in MODELS and not getattr(MODELS[name], "hf_model_types", ())


def check_hf_files(folder: Path, field: str) -> None:
    """A Hugging Face folder's files alone: ``config.json`` a JSON object, the safetensors
    headers intact."""
    read_json(folder / "config.json", field, str(folder), _HF_FIX)
    safetensors_shapes(folder, field, str(folder), _HF_FIX)


def hf_family(folder: Path, field: str) -> tuple[str, Any]:
    """(our family, its args) from ``folder/config.json``: a model type we train, every key
    readable."""
    value = str(folder)
    config = read_json(folder / "config.json", field, value, _HF_FIX)
    model_type = config.get("model_type", "llama")
    known = {t: n for n, s in MODELS.items() for t in getattr(s, "hf_model_types", ())}
    if not isinstance(model_type, str) or model_type not in known:
        arch = config.get("architectures")
        rule = f"{folder}/config.json has model_type {model_type!r} (architectures {arch!r}), "
        rule += f"which no family here trains (model types: {sorted(known)})"
        raise ConfigError(field, value, rule, "use a model of one of those families")
    try:
        family, args = family_for_hf_config(config)
    except ConfigError as e:  # a key the family's table refuses (models/<family>/hf_keys.py)
        rule = f"{folder}/{e.field}" + ("" if e.value is None else f" = {e.value!r}")
        raise ConfigError(field, value, f"{rule}: {e.rule}", e.fix) from None
    except KeyError as e:
        rule = f"{folder}/config.json lacks the key {e.args[0]!r} a {known[model_type]} model needs"
        raise ConfigError(field, value, rule, _HF_FIX) from None
    except Exception as e:  # noqa: BLE001 - a value of the wrong type or out of range
        rule = f"{folder}/config.json cannot be read as a {known[model_type]} config ({e})"
        raise ConfigError(field, value, rule, _HF_FIX) from None
    for f in MODELS[family].hf.config.fields:  # type: ignore[attr-defined]
        got = getattr(args, f.ours or "", None)
        if f.ours in _COUNTS and not (type(got) is int and got >= 1):
            rule = f"{folder}/config.json has {f.hf} = {config.get(f.hf)!r}: must be >= 1"
            raise ConfigError(field, value, rule, _HF_FIX)
    n_tensors = len(safetensors_shapes(folder, field, value, _HF_FIX))
    if args.n_layers > n_tensors:  # before building (a huge count would take minutes)
        rule = f"{folder}/config.json has {args.n_layers} layers, more than the {n_tensors} "
        rule += "tensors of its *.safetensors files"
        raise ConfigError(field, value, rule, "fix num_hidden_layers, or give the whole folder")
    meta_shapes(family, args, field, value, f"{folder}/config.json")  # buildable
    return family, args


def meta_shapes(family: str, args: Any, field: str, value: Any, source: str) -> dict[str, Any]:
    """Our tensor names -> shapes of ``family`` built on the meta device with ``args``; args
    that build no model (a negative width, a string) are the ``source``'s fault."""
    try:
        with torch.device("meta"):
            model = MODELS[family].build(args)
        return {k: tuple(v.shape) for k, v in model.state_dict().items()}
    except Exception as e:  # noqa: BLE001 - any failure to build is a bad config value
        why = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        rule = f"{source} describes no buildable {family} model ({why})"
        raise ConfigError(field, value, rule, "fix the config's sizes") from None


def check_hf_model(
    folder: Path, field: str, family: str, args: Any, what: str, fit: bool = False
) -> None:
    """Every tensor ``family`` built with ``args`` reads is in ``folder`` with its shape
    (``fit``: with the args the importers take for those weights, ``args_for_weights``:
    DeepSeek-V3's MTP layers a config.json declares and the weights lack are left out)."""
    value = str(folder)
    adapter: Any = MODELS[family].state_dict_adapter(args)
    if adapter is None:
        raise ConfigError(field, value, f"{family} has no Hugging Face format", _HF_FIX)
    found = safetensors_shapes(folder, field, value, _HF_FIX)
    spelled = getattr(adapter, "as_exported", None)
    if spelled is not None:  # a family that reads several spellings of its names (kimi_k25)
        found = {spelled(name): shape for name, shape in found.items()}
    if fit and hasattr(adapter, "args_for_weights"):
        args = adapter.args_for_weights(list(found))
        adapter = MODELS[family].state_dict_adapter(args)
    ours = meta_shapes(family, args, field, value, what)
    try:
        expected = expected_hf_shapes(adapter, ours)
    except Exception as e:  # noqa: BLE001 - a layout the family's transforms cannot express
        rule = f"{what} has no Hugging Face layout ({type(e).__name__}: {str(e)[:120]})"
        raise ConfigError(field, value, rule, "fix the config's sizes") from None
    check_hf_tensors(found, expected, field, value, what, "use the folder of that model")


def _shape_problem(ours: dict[str, Any], saved: dict[str, Any]) -> str | None:
    for name in sorted(set(ours) | set(saved)):
        if name not in saved:
            return f"it has no {name}"
        if name not in ours:
            return f"it holds {name}, which the model has not"
        if tuple(saved[name]) != tuple(ours[name]):
            return f"{name} is {list(saved[name])} there, {list(ours[name])} in the model"
    return None


def check_dcp_model(
    path: Path, field: str, family: str, flavor: str, args: Any = None
) -> dict[str, Any]:
    """The DCP folder's model tensors are those of ``family``/``flavor`` (``args``: the
    run's, else the flavor's; the vocabulary from its embedding); returns its ``name ->
    (shape, dtype)``. A mismatch names the flavors of ``family`` that do fit, if any."""
    saved = dcp_model_shapes(path, field)
    shapes = {k: v[0] for k, v in saved.items()}
    spec = MODELS[family]

    def problem(name: str) -> str | None:
        args_ = args if args is not None and name == flavor else spec.flavors[name]
        if "tok_embeddings.weight" in shapes:  # the trainer sets it from the tokenizer
            args_ = dataclasses.replace(args_, vocab_size=shapes["tok_embeddings.weight"][0])
        return _shape_problem(meta_shapes(family, args_, field, str(path), flavor), shapes)

    why = problem(flavor)
    if why is not None:
        fits = [f for f in spec.flavors if f != flavor and problem(f) is None]
        fix = (
            f"use flavor {fits[0]}"
            if fits
            else f"give the model name and flavor it was trained as ({family} flavors: "
            f"{list(spec.flavors)}; another family's checkpoint fits none of them)"
        )
        raise ConfigError(field, str(path), f"is not a {family} {flavor} checkpoint: {why}", fix)
    return saved


def _run_args(cfg: JobConfig) -> Any:
    """The args the trainer builds (``Trainer._build_model``), the attention backend aside."""
    from torchtitan.data.tokenizer import build_tokenizer

    vocab = build_tokenizer(cfg.model.tokenizer_path).vocab_size  # validated before
    return run_args(cfg, vocab)  # with the HF folder's honoured settings (models/__init__.py)


def _compare_configs(folder: Path, family: str, theirs: Any, cfg: JobConfig) -> None:
    """The folder's ``config.json`` describes the run's model: the family, then each key of
    the family's config translation (the context length excepted: the run sets its own)."""
    field, value = "checkpoint.initial_load_path", str(folder)
    name = cfg.model.name
    hf = MODELS[name].hf  # type: ignore[attr-defined]
    ours_args = _run_args(cfg)
    mine, there = hf.config.to_hf(ours_args), hf.config.to_hf(theirs)
    skip = {"max_position_embeddings", hf.config.dtype_key}
    # a run may train fewer multi-token-prediction layers than the folder holds
    mtp = {f.hf for f in hf.config.fields if f.ours == "mtp_depth"}
    for key in [*mine, *(k for k in there if k not in mine)]:  # the family's order
        if key in skip or mine.get(key) == there.get(key):
            continue
        if key in mtp and isinstance(there.get(key), int) and mine[key] <= there[key]:
            continue
        rule = (
            f"{folder}/config.json has {key} = {there.get(key)!r}, the run's model "
            f"({name} {cfg.model.flavor}) has {mine.get(key)!r}"
        )
        fix = "use the model.flavor (and tokenizer) of that folder's model, or its own folder"
        raise ConfigError(field, value, rule, fix)


def validate_hf_family(cfg: JobConfig) -> None:
    """With ``initial_load_in_hf``: the folder's ``config.json`` is readable and describes a
    model of the run's family (before the flavor's fields are compared with it)."""
    ck = cfg.checkpoint
    if not (ck.initial_load_in_hf and ck.initial_load_path) or cfg.model.name not in MODELS:
        return
    path, field = Path(ck.initial_load_path), "checkpoint.initial_load_path"
    if by_own_config(cfg.model.name):
        check_hf_files(path, field)
        return
    family, _ = hf_family(path, field)
    name = cfg.model.name
    if family != name:
        rule = f"{path}/config.json describes a {family} model, the run trains {name}"
        raise ConfigError(field, str(path), rule, f"use --model.name {family}, or a {name} folder")


def validate_initial_load(cfg: JobConfig) -> None:
    """``checkpoint.initial_load_path``: a Hugging Face folder of the run's model (with
    ``initial_load_in_hf``), else one intact DCP step folder of the run's model."""
    ck = cfg.checkpoint
    if not ck.initial_load_path or cfg.model.name not in MODELS:
        return
    path, field = Path(ck.initial_load_path), "checkpoint.initial_load_path"
    if ck.initial_load_in_hf:
        validate_hf_family(cfg)
        if by_own_config(cfg.model.name):
            return
        family, theirs = hf_family(path, field)
        _compare_configs(path, family, theirs, cfg)
        check_hf_model(path, field, family, _run_args(cfg), f"the run's model ({family})")
        return
    hint = "add --checkpoint.initial_load_in_hf to load a Hugging Face folder"
    check_dcp_folder(path, field, hint, ck.verify_checksums)
    if cfg.lora.enable or by_own_config(cfg.model.name):
        return
    if flavor_of(cfg) not in MODELS[cfg.model.name].flavors:
        return
    run = _run_args(cfg)
    saved = check_dcp_model(path, field, cfg.model.name, cfg.model.flavor, run)
    rows, vocab = saved.get("tok_embeddings.weight", ((None,), None))[0][0], run.vocab_size
    if rows is not None and rows != vocab:
        rule = f"its embedding has {rows} rows, the run's tokenizer {vocab} tokens"
        fix = "use the tokenizer (model.tokenizer_path) that checkpoint was trained with"
        raise ConfigError(field, str(path), rule, fix)


def validate_eval_checkpoint(cfg: JobConfig, path: Path) -> None:
    """``python -m torchtitan.eval``'s checkpoint: a Hugging Face folder of a family we train,
    intact; or a DCP step folder (or a root holding one) of ``model.name``/``model.flavor``."""
    field, value = "eval.checkpoint", str(path)
    if not path.exists():
        fix = "name a step-N folder, a checkpoint root or a Hugging Face folder"
        raise ConfigError(field, value, "does not exist", fix)
    if (path / "config.json").is_file() and by_own_config(cfg.model.name):
        check_hf_files(path, field)
        return
    if (path / "config.json").is_file():
        family, args = hf_family(path, field)
        check_hf_model(path, field, family, args, f"its config.json's {family} model", fit=True)
        return
    steps = io.complete_steps(path) if not (path / ".metadata").is_file() else []
    if steps:  # a checkpoint root: its newest valid step (what evaluate() picks)
        why = {s: io.verify(io.step_dir(path, s)) for s in reversed(steps)}
        valid = [s for s, reason in why.items() if reason is None]
        if not valid:
            shown = "; ".join(f"step-{s}: {r}" for s, r in why.items())
            rule = f"holds no valid checkpoint ({shown})"
            fix = "repair one (docs/checkpoint.md) or name a step-N folder"
            raise ConfigError(field, value, rule, fix)
        path = io.step_dir(path, valid[0])
    hint = "a Hugging Face folder needs its config.json beside the *.safetensors files"
    check_dcp_folder(path, field, hint)
    if by_own_config(cfg.model.name):
        return
    if cfg.model.name in MODELS and flavor_of(cfg) in MODELS[cfg.model.name].flavors:
        check_dcp_model(path, field, cfg.model.name, cfg.model.flavor)


def validate_peft_folder(cfg: JobConfig) -> None:
    """``lora.adapter_path``'s files: ``adapter_config.json`` a LoRA config whose ``r``,
    ``lora_alpha`` and ``use_rslora`` are numbers (a flag), ``adapter_model.safetensors`` intact,
    each ``lora_A`` of rank ``r``. Whether they are the adapters ``[lora]`` builds, at its rank,
    is ``lora/peft_io.py: check_adapters`` (called after this, from ``validate_lora``)."""
    lo = cfg.lora
    if not (lo.enable and lo.adapter_path):
        return
    folder, field = Path(lo.adapter_path), "lora.adapter_path"
    fix = "point it at a folder written by scripts/export_lora.py or PEFT's save_pretrained"
    config = read_json(folder / "adapter_config.json", field, lo.adapter_path, fix)
    if config.get("peft_type") != "LORA":
        rule = f"{folder}/adapter_config.json has peft_type {config.get('peft_type')!r}, not LORA"
        raise ConfigError(field, lo.adapter_path, rule, fix)
    for key, kind in (("r", int), ("lora_alpha", float), ("use_rslora", bool)):
        got: Any = config.get(key, False if key == "use_rslora" else None)
        if kind is bool:
            ok = isinstance(got, bool)
        else:  # a number (r: a whole one >= 1), finite
            ok = isinstance(got, (int, float)) and not isinstance(got, bool)
            ok = ok and math.isfinite(got) and got > 0
            ok = ok and (kind is float or float(got).is_integer())
        if not ok:
            rule = f"{folder}/adapter_config.json has {key} = {got!r}, not a {kind.__name__}"
            rule += " > 0" if kind is not bool else ""
            raise ConfigError(field, lo.adapter_path, rule, fix)
    weights = folder / "adapter_model.safetensors"
    if not weights.is_file():
        raise ConfigError(field, lo.adapter_path, f"{weights} does not exist", fix)
    r = int(config["r"])
    for name, shape in safetensors_shapes(folder, field, lo.adapter_path, fix).items():
        if ".lora_A." in name and (len(shape) != 2 or shape[0] != r):
            rule = f"{weights}: {name} has shape {list(shape)}, not rank {r} (its r)"
            raise ConfigError(field, lo.adapter_path, rule, fix)
