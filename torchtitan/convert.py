"""One converter for every family: a DCP ``step-N`` folder <-> a sharded Hugging Face folder.

    python -m torchtitan.convert to-hf CHECKPOINT/step-N HF_OUT --model llama3 --flavor 8B \\
        [--dtype bfloat16] [--max-shard-gb 5] [--max-seq-len N] [--no-verify]
    python -m torchtitan.convert from-hf HF_FOLDER CHECKPOINT_ROOT --model qwen3 \\
        [--flavor 30B-A3B] [--step 0] [--dtype bfloat16] [--no-verify]
    torchrun --nproc_per_node N -m torchtitan.convert ...   # each rank holds 1/N of the model

The model is held as ``Shard(0)`` DTensors on a 1-D mesh of the ranks (plain tensors in one
process), filled by DCP or by the streaming Hugging Face import, and written by DCP or by the
streaming export (``checkpoint/hf_io.py``; docs/hf_io.md): no rank ever holds more than its
shard plus one full tensor. After writing, the output is read back the same way and compared
bitwise (``--no-verify`` skips it). Conversion runs on host memory, so the group is gloo.
Every argument and input folder is checked first, before any process group or model
(``preflight/validate_convert.py``): bad input is one line ``config error: <argument> = <value>: ...
Fix: ...`` and exit 2, and nothing is written.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from torchtitan.checkpoint import hf_io
from torchtitan.checkpoint import storage as io
from torchtitan.checkpoint.trust import SafeFileSystemReader, SafeLoadPlanner
from torchtitan.checkpoint.write_errors import CheckpointWriteError, make_step_folder
from torchtitan.config.errors import ConfigError
from torchtitan.models import MODELS
from torchtitan.models.spec import FamilySpec
from torchtitan.preflight import validate_convert as checks
from torchtitan.tools.fault_injection import Faults
from torchtitan.tools.torch_compat import single_process_dcp

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
Shapes = dict[str, tuple[tuple[int, ...], torch.dtype]]


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _say(text: str) -> None:
    if _rank() == 0:
        print(text, flush=True)


def _mesh() -> DeviceMesh | None:
    """A 1-D gloo mesh over the ranks under torchrun, None in one process."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return init_device_mesh("cpu", (dist.get_world_size(),))


def sharded_empty(shapes: Shapes, mesh: DeviceMesh | None) -> dict[str, torch.Tensor]:
    """Uninitialised tensors of ``shapes``: ``Shard(0)`` DTensors on ``mesh``, else plain."""
    out: dict[str, torch.Tensor] = {}
    for name, (shape, dtype) in shapes.items():
        if mesh is None:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        local, _ = compute_local_shape_and_global_offset(shape, mesh, [Shard(0)])
        out[name] = DTensor.from_local(
            torch.empty(local, dtype=dtype),
            mesh,
            [Shard(0)],
            run_check=False,
            shape=torch.Size(shape),
            stride=torch.empty(shape, device="meta").stride(),
        )
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _equal_everywhere(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose shards differ on any rank."""
    bad = [k for k in a if not torch.equal(_local(a[k]), _local(b[k]).to(_local(a[k]).dtype))]
    if dist.is_initialized():
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, bad)
        bad = sorted({k for part in gathered for k in part})
    return bad


def _family(name: str) -> Any:
    spec = MODELS.get(name)
    if spec is None or (isinstance(spec, FamilySpec) and spec.hf is None):
        with_hf = sorted(n for n, s in MODELS.items() if getattr(s, "hf", None) is not None)
        raise ConfigError("--model", name, "has no Hugging Face mapping", f"use one of {with_hf}")
    return spec


def _model_shapes(spec: Any, args: Any, dtype: torch.dtype | None) -> Shapes:
    with torch.device("meta"):
        model = spec.build(args)
    return {k: (tuple(v.shape), dtype or v.dtype) for k, v in model.state_dict().items()}


def _checkpoint_shapes(checkpoint: Path) -> Shapes:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = SafeFileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    return {
        k.removeprefix("model."): (tuple(m.size), m.properties.dtype)
        for k, m in metadata.items()
        if k.startswith("model.") and isinstance(m, TensorStorageMetadata)
    }


def _check_same(ours: Shapes, theirs: Shapes, what: str) -> None:
    for name in sorted(set(ours) | set(theirs)):
        a, b = ours.get(name, (None,))[0], theirs.get(name, (None,))[0]
        if a != b:
            rule = f"{name} is {b} there, {a} in the model"
            raise ConfigError("checkpoint", what, rule, "give the --flavor it was trained as")


def _dcp_read(sd: dict[str, torch.Tensor], checkpoint: Path) -> None:
    with single_process_dcp():  # its warning when no process group is running
        dcp.load(
            {"model": sd},
            storage_reader=SafeFileSystemReader(str(checkpoint)),
            planner=SafeLoadPlanner(),
            no_dist=not dist.is_initialized(),
        )


def _nbytes(sd: dict[str, torch.Tensor]) -> int:
    return sum(_local(t).nbytes for t in sd.values())


def to_hf(
    checkpoint: Path,
    out: Path,
    model: str,
    args: Any,
    dtype: torch.dtype | None,
    max_shard_bytes: int = hf_io.DEFAULT_SHARD_BYTES,
    verify: bool = True,
) -> int:
    """Export the ``model`` weights of a DCP step folder; returns the number of HF tensors."""
    spec, mesh = _family(model), _mesh()
    saved = _checkpoint_shapes(checkpoint)
    embedding = f"{spec.parallel_plan(args).embedding}.weight"
    if embedding in saved:  # the trainer sets the vocabulary from the tokenizer
        args = dataclasses.replace(args, vocab_size=saved[embedding][0][0])
    _check_same(_model_shapes(spec, args, None), saved, f"{checkpoint}")
    sd = sharded_empty(saved, mesh)
    t0 = time.perf_counter()
    _dcp_read(sd, checkpoint)
    seconds = time.perf_counter() - t0
    _say(f"read {checkpoint}: {_nbytes(sd) / 1e9:.2f} GB on rank 0 in {seconds:.1f} s")
    adapter = spec.state_dict_adapter(args)
    progress = hf_io.save_hf_streaming(
        sd, adapter, out, dtype, max_shard_bytes, verbose=_rank() == 0
    )
    _say(f"wrote {out}: {progress.line()} on rank 0")
    if verify:
        back = sharded_empty({k: (v[0], dtype or v[1]) for k, v in saved.items()}, mesh)
        hf_io.load_hf_state_dict(back, adapter, out)
        bad = _equal_everywhere(back, sd)
        if bad:
            raise RuntimeError(f"verification failed: {len(bad)} tensors differ: {bad[:5]}")
        _say(f"verified: {len(back)} tensors read back from {out} are bitwise equal")
    index = json.loads((out / hf_io.INDEX).read_text())
    return len(index["weight_map"])


def from_hf(
    folder: Path,
    root: Path,
    model: str,
    step: int = 0,
    flavor: str | None = None,
    dtype: torch.dtype | None = None,
    verify: bool = True,
) -> Path:
    """Import a Hugging Face folder as the model-only ``root/step-<step>`` checkpoint."""
    spec, mesh = _family(model), _mesh()
    assert spec.hf is not None
    args = spec.hf.config.args_from_hf(json.loads((folder / "config.json").read_text()))
    if flavor is not None:
        checks.check_flavor(args, spec, flavor, folder)
    source = hf_io.SafetensorsFolder(folder)
    adapter = spec.state_dict_adapter(args)
    assert adapter is not None
    args = adapter.args_for_weights(source.names())  # modules config.json declares, weights lack
    adapter = spec.state_dict_adapter(args)
    assert adapter is not None
    first = adapter.to_hf_one("tok_embeddings.weight", torch.empty(0, device="meta"))[0][0]
    shapes = _model_shapes(spec, args, dtype or source.dtype(first))
    sd = sharded_empty(shapes, mesh)
    progress = hf_io.load_hf_state_dict(sd, adapter, folder, verbose=_rank() == 0)
    _say(f"read {folder}: {progress.line()} on rank 0")
    # rank 0 creates step-N.tmp; its error reaches every rank (no rank left at a barrier)
    pg = dist.group.WORLD if dist.is_initialized() else None
    tmp = make_step_folder(root, step, _rank(), pg, Faults(_rank()))
    t0 = time.perf_counter()
    with single_process_dcp():
        dcp.save({"model": sd}, checkpoint_id=str(tmp), no_dist=not dist.is_initialized())
    seconds = time.perf_counter() - t0
    _say(f"wrote DCP: {_nbytes(sd) / 1e9:.2f} GB on rank 0 in {seconds:.1f} s")
    if dist.is_initialized():
        dist.barrier()
    world = dist.get_world_size() if dist.is_initialized() else 1
    if _rank() == 0:
        io.commit(root, step, {}, world_size=world, kind="seed")
    if dist.is_initialized():
        dist.barrier()
    path = io.step_dir(root, step)
    if verify:
        back = sharded_empty(shapes, mesh)
        _dcp_read(back, path)
        bad = _equal_everywhere(back, sd)
        if bad:
            raise RuntimeError(f"verification failed: {len(bad)} tensors differ: {bad[:5]}")
        _say(f"verified: {len(back)} tensors read back from {path} are bitwise equal")
    _say(f"model args: {args}")
    return path


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line, exit 2 (docs/errors.md)."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {self.prog}: {message}. Fix: see {self.prog} --help.", file=sys.stderr)
        sys.exit(2)


def parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m torchtitan.convert",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True)
    out = sub.add_parser("to-hf", help="a DCP step folder -> a Hugging Face folder")
    out.add_argument("checkpoint", type=Path, help="a step-N checkpoint folder")
    out.add_argument("output", type=Path, help="folder for the Hugging Face files")
    out.add_argument("--flavor", required=True)
    out.add_argument("--max-seq-len", type=int, default=None, help="max_position_embeddings")
    out.add_argument("--max-shard-gb", type=float, default=hf_io.DEFAULT_SHARD_BYTES / 1e9)
    inp = sub.add_parser("from-hf", help="a Hugging Face folder -> a model-only DCP checkpoint")
    inp.add_argument("hf_folder", type=Path)
    inp.add_argument("output", type=Path, help="checkpoint root; step-<step> is created in it")
    inp.add_argument("--flavor", default=None, help="refuse a config.json of another shape")
    inp.add_argument("--step", type=int, default=0)
    for s in (out, inp):
        s.add_argument("--model", required=True, choices=sorted(MODELS))
        s.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: as is")
        s.add_argument("--no-verify", dest="verify", action="store_false")
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    dtype = DTYPES[a.dtype] if a.dtype else None
    try:
        if a.command == "to-hf":
            args, shard = checks.check_to_hf(a)  # before any process group or model
            n = to_hf(a.checkpoint, a.output, a.model, args, dtype, shard, a.verify)
            _say(f"wrote {n} tensors to {a.output}")
        else:
            checks.check_from_hf(a)
            path = from_hf(a.hf_folder, a.output, a.model, a.step, a.flavor, dtype, a.verify)
            _say(f"wrote {path}")
    except ConfigError as e:  # bad input, a config.json key we cannot compute: exit 2
        if os.environ.get("RANK", "0") == "0":  # one line (rank 0's under torchrun)
            print(f"config error: {e}", file=sys.stderr)
        return 2
    except CheckpointWriteError as e:  # a full disk or no permission: one line, exit 4
        print(f"error: {e}", file=sys.stderr)
        return 4
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
