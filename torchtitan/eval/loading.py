"""A checkpoint as an evaluation model: weights from a DCP step folder or a Hugging Face folder,
built for any family of ``MODELS`` and split with the trainer's parallelize path (docs/evaluation.md).

- DCP: a ``step-N`` folder written by the trainer, or the checkpoint root (the newest valid step
  is used, a final ``export`` included); the shape comes from ``model.name``/``model.flavor``,
  the vocabulary size from the weights.
- Hugging Face: ``config.json`` + ``*.safetensors``; the family comes from ``model_type``, the
  tensors the family reads are streamed in by its ``state_dict_adapter(args)``
  (``checkpoint/hf_io.py``). ``python -m torchtitan.eval`` checks the folder first
  (``preflight/validate_weights.py``: one line, exit 2).

``python -m torchtitan.eval`` (:func:`checkpoint_args`, :func:`load_eval_model`) reads no weight
before the model is built and split: each rank then streams only the weights it holds (its
tensor-parallel shards) into the split model, from a Hugging Face folder as training's import
does (``checkpoint/hf_io.py``: the rank's shard plus one box in host memory) or from a DCP
folder by DCP's sharded load. :func:`load_weights` (the whole state dict, one process) serves
``scripts/generate.py`` and the tests. The model is parallelized by ``distributed.parallelize``
with the tensor-parallel degree only (data-parallel ranks hold whole replicas and evaluate
different requests; no FSDP or DDP wrapper), logits gathered on every rank.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchtitan.checkpoint import hf_io
from torchtitan.checkpoint import storage as io
from torchtitan.config.errors import ConfigError
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.parallelize import parallelize
from torchtitan.models import MODELS, family_for_hf_config

__all__ = ["build_eval_model", "checkpoint_args", "load_eval_model", "load_weights"]


def load_weights(
    path: Path, hf: bool, model: str, flavor: str
) -> tuple[str, Any, dict[str, torch.Tensor]]:
    """(family, model args, full native state dict) of a checkpoint, read in this process."""
    if hf and model == "hf":  # any transformers causal LM, by its own config (docs/hf_models.md)
        _, hf_sd = io.read_hf_folder(path)
        args = MODELS["hf"].flavors[str(path)]
        return "hf", args, MODELS["hf"].state_dict_adapter(args).from_hf(hf_sd)  # type: ignore[union-attr]
    if hf:
        return _load_hf(path)
    if not (path / ".metadata").is_file():  # the checkpoint root: the newest valid step
        found = io.find_checkpoint(path, skip_exports=False)
        if found is None:
            raise FileNotFoundError(f"no valid step-N checkpoint under {path}")
        path = found.path
    sd = io.read_model_weights(path)
    base = MODELS[model].flavors[flavor]
    embedding = f"{MODELS[model].parallel_plan(base).embedding}.weight"
    args = dataclasses.replace(base, vocab_size=sd[embedding].shape[0])
    return model, args, sd


def _load_hf(path: Path) -> tuple[str, Any, dict[str, torch.Tensor]]:
    """A Hugging Face folder streamed into our names: only the tensors the family reads (extra
    ones, e.g. a cached RoPE table, are left), in the files' dtype."""
    family, args = _hf_args(path)
    spec = MODELS[family]
    adapter: Any = spec.state_dict_adapter(args)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in spec.build(args).state_dict().items()}
    first = adapter.to_hf_one("tok_embeddings.weight", torch.empty(0, device="meta"))[0][0]
    dtype = hf_io.SafetensorsFolder(path).dtype(first)
    sd = {k: torch.empty(shape, dtype=dtype) for k, shape in shapes.items()}
    hf_io.load_hf_state_dict(sd, adapter, path)
    return family, args, sd


def _hf_args(path: Path) -> tuple[str, Any]:
    """(family, args) of a Hugging Face folder from its ``config.json``, fitted to the layers
    its weights hold (DeepSeek-V3's MTP layers a transformers save lacks: left out, logged)."""
    try:
        family, args = family_for_hf_config(json.loads((path / "config.json").read_text()))
    except ConfigError:  # a config.json key we cannot compute (docs/hf_io.md): exit 2
        raise
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    adapter: Any = MODELS[family].state_dict_adapter(args)
    assert adapter is not None
    fit = getattr(adapter, "args_for_weights", None)  # modules config.json declares that
    if fit is not None:  # the weights lack (DeepSeek-V3's MTP layers): left out, logged
        args = fit(hf_io.SafetensorsFolder(path).names())
    return family, args


def checkpoint_args(
    path: Path, hf: bool, model: str, flavor: str, trust_remote_code: bool = False
) -> tuple[str, Any]:
    """(family, model args) of a checkpoint, reading no weights: a Hugging Face folder's
    ``config.json`` (and its tensor names), or a DCP folder's metadata (the vocabulary is its
    embedding's row count). ``trust_remote_code`` (``model.hf_trust_remote_code``): an ``hf``
    folder's own Python classes may be built (docs/hf_models.md, "Remote code")."""
    if hf and model == "hf":  # any transformers causal LM, by its own config (docs/hf_models.md)
        from torchtitan.models.hf.args import flavor_key

        return "hf", MODELS["hf"].flavors[flavor_key(str(path), trust_remote_code)]
    if hf:
        return _hf_args(path)
    from torchtitan.checkpoint.trust import SafeFileSystemReader

    base = MODELS[model].flavors[flavor]
    embedding = f"model.{MODELS[model].parallel_plan(base).embedding}.weight"
    meta: Any = SafeFileSystemReader(str(path)).read_metadata().state_dict_metadata[embedding]
    return model, dataclasses.replace(base, vocab_size=meta.size[0])


def load_eval_model(
    path: Path,
    hf: bool,
    family: str,
    args: Any,
    dims: ParallelDims,
    cfg: JobConfig,
    device: torch.device,
    dtype: torch.dtype,
) -> nn.Module:
    """The checkpoint's model in eval mode, split over ``dims``' tp axis, each rank reading only
    the weights it holds straight into its shards."""
    spec = MODELS[family]
    model = _split_on_meta(family, args, dims, cfg, dtype)
    model.to_empty(device=device)
    with torch.no_grad():
        if hf:
            hf_io.load_hf_streaming([model], spec.state_dict_adapter(args), path)
        else:
            _load_dcp_model(model, path)
    return _finish(model, device, dtype)


def _load_dcp_model(model: nn.Module, path: Path) -> None:
    """The ``model`` entries of a DCP step folder into ``model``'s (possibly sharded) tensors:
    DCP reads only each rank's boxes."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from torchtitan.checkpoint.trust import SafeFileSystemReader, SafeLoadPlanner
    from torchtitan.tools.torch_compat import single_process_dcp

    sd = get_model_state_dict(model)
    with single_process_dcp():
        dcp.load(
            {"model": sd},
            storage_reader=SafeFileSystemReader(str(path)),
            planner=SafeLoadPlanner(),
            no_dist=not dist.is_initialized(),
        )
    set_model_state_dict(model, sd)


def _tp_only(dims: ParallelDims) -> ParallelDims:
    """``dims`` seen by ``parallelize`` with only its tensor-parallel axis: the same world mesh,
    no data-parallel wrapper (replicas evaluate different requests)."""
    view = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=dims.tp, pp=1, world_size=dims.tp)
    view._mesh = dims.world_mesh
    return view


def build_eval_model(
    family: str,
    args: Any,
    sd: dict[str, torch.Tensor],
    dims: ParallelDims,
    cfg: JobConfig,
    device: torch.device,
    dtype: torch.dtype,
) -> nn.Module:
    """The model with ``sd`` loaded, in eval mode, split over ``dims``' tp axis."""
    model = _split_on_meta(family, args, dims, cfg, dtype)
    return materialize(model, sd, device, dtype, sharded=dims.tp_enabled)


def _split_on_meta(
    family: str, args: Any, dims: ParallelDims, cfg: JobConfig, dtype: torch.dtype
) -> nn.Module:
    """The model on ``meta``, split over ``dims``' tp axis (full logits on every rank)."""
    spec = MODELS[family]
    with torch.device("meta"):
        model = spec.build(args)
    if dims.tp_enabled:
        eval_cfg = copy.deepcopy(cfg)
        eval_cfg.parallelism.disable_loss_parallel = True  # full logits on every rank
        eval_cfg.training.loss_chunk_size = 0
        eval_cfg.activation_checkpoint.mode = "none"
        eval_cfg.compile.enable = False
        parallelize(model, spec.parallel_plan(args), _tp_only(dims), eval_cfg, dtype, dtype)
    return model


def materialize(
    model: nn.Module,
    sd: dict[str, torch.Tensor],
    device: torch.device,
    dtype: torch.dtype,
    sharded: bool,
) -> nn.Module:
    """``model`` (built on the meta device; ``sharded``: tensor parallel applied) on ``device``
    with the full state dict ``sd`` loaded (a sharded model keeps its shards of it), its
    buffers computed, cast to ``dtype``, in eval mode (also ``scripts/generate.py``'s)."""
    model.to_empty(device=device)
    if sharded:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
        )

        full: dict[str, Any] = dict(sd)  # every rank holds it all and keeps its shards
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True))
    else:
        model.load_state_dict(sd, strict=True)
    return _finish(model, device, dtype)


def _finish(model: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """Buffers computed on ``device``, cast to ``dtype``, eval mode."""
    model.init_buffers(device)  # type: ignore[operator]
    with warnings.catch_warnings():
        # nn.Module.to casts the complex RoPE table too; Transformer._apply recomputes it.
        warnings.filterwarnings("ignore", message="Casting complex values to real")
        model.to(dtype)
    return model.eval()
