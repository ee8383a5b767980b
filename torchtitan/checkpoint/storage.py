"""The on-disk side of checkpoints: folder names, the manifest, atomic commit, verification.

A checkpoint of step N is written to ``<root>/step-N.tmp`` and becomes ``<root>/step-N`` by one
``rename`` once every rank has finished writing and the manifest is in place. The manifest
(``manifest.json``) lists every file with its size and SHA-256, so a folder that was truncated,
lost a file, or had bytes flipped is recognised and skipped. Nothing here uses a process group:
the manager gathers the per-rank file digests and calls these functions on one rank.

The manifest also records the checkpoint's ``kind``: ``full`` (everything, resumable),
``seed`` (model only, step 0: checkpoint.create_seed_checkpoint) or ``export`` (model only,
possibly cast: checkpoint.last_save_model_only). Automatic resume skips ``export`` folders:
they lack the optimizer, data position and RNG, so resuming from them would not continue the
run.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from torchtitan.tools.logging import logger

MANIFEST = "manifest.json"
TMP_SUFFIX = ".tmp"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step-(\d+)$")
_CHUNK = 8 << 20
KINDS = ("full", "seed", "export")


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step}"


def tmp_dir(root: Path, step: int) -> Path:
    return root / f"step-{step}{TMP_SUFFIX}"


def file_digest(path: Path) -> dict[str, int | str]:
    """``{"size": bytes, "sha256": hex}`` of one file, read in 8 MiB chunks."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": h.hexdigest()}


def digest_files(folder: Path, prefix: str | None) -> dict[str, dict[str, int | str]]:
    """Digests of the files in ``folder`` whose name starts with ``prefix`` (all when None)."""
    return {
        p.name: file_digest(p)
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name != MANIFEST and (prefix is None or p.name.startswith(prefix))
    }


def commit(
    root: Path,
    step: int,
    files: dict[str, dict[str, int | str]],
    world_size: int,
    kind: str = "full",
) -> Path:
    """Write the manifest into ``step-N.tmp`` (digesting any file not in ``files``) and rename
    it to ``step-N``. An existing ``step-N`` (e.g. a corrupt one that was skipped at load) is
    replaced. Returns the final folder."""
    assert kind in KINDS, kind
    tmp, final = tmp_dir(root, step), step_dir(root, step)
    on_disk = {p.name for p in tmp.iterdir() if p.is_file() and p.name != MANIFEST}
    for name in sorted(on_disk - set(files)):
        files[name] = file_digest(tmp / name)
    missing = set(files) - on_disk
    if missing:
        raise RuntimeError(f"checkpoint {tmp}: files reported by ranks are missing: {missing}")
    manifest = {
        "format": FORMAT_VERSION,
        "step": step,
        "world_size": world_size,
        "kind": kind,
        "files": dict(sorted(files.items())),
    }
    with open(tmp / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    if final.exists():
        logger.warning(f"checkpoint: replacing the existing {final}")
        trash = root / f"step-{step}.replaced"
        shutil.rmtree(trash, ignore_errors=True)
        final.rename(trash)
        shutil.rmtree(trash, ignore_errors=True)
    tmp.rename(final)
    _fsync_dir(root)
    return final


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def verify(folder: Path, checksums: bool = True) -> str | None:
    """Why ``folder`` is not a complete checkpoint, or None when it is. Checks that the manifest
    exists, every listed file exists with its size, and (``checksums``) its SHA-256."""
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        return "no manifest (the save did not finish)"
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as e:
        return f"unreadable manifest ({e!r})"
    if not isinstance(files, dict) or not all(_entry_ok(k, v) for k, v in files.items()):
        return "unreadable manifest (its files are not {name: {size, sha256}})"
    if ".metadata" not in files:
        return "the manifest lists no .metadata file"
    for name, want in files.items():
        path = folder / name
        if not path.is_file():
            return f"file {name} is missing"
        size = path.stat().st_size
        if size != want["size"]:
            return f"file {name} has {size} bytes, the manifest says {want['size']}"
    if checksums:
        for name, want in files.items():
            got = file_digest(folder / name)["sha256"]
            if got != want["sha256"]:
                return f"file {name} fails its SHA-256 check"
    return None


def _entry_ok(name: str, entry: object) -> bool:
    """A manifest entry: a plain file name of this folder, its size and SHA-256."""
    return (
        bool(name)
        and name not in (".", "..")
        and "/" not in name
        and isinstance(entry, dict)
        and type(entry.get("size")) is int
        and isinstance(entry.get("sha256"), str)
    )


def kind(folder: Path) -> str:
    """The manifest's ``kind`` (``full`` for a manifest without one, or none readable)."""
    try:
        return str(json.loads((folder / MANIFEST).read_text()).get("kind", "full"))
    except (OSError, ValueError):
        return "full"


@dataclass(frozen=True)
class Found:
    step: int
    path: Path


def complete_steps(root: Path) -> list[int]:
    """Steps that have a ``step-N`` folder (committed; not yet verified), ascending."""
    if not root.is_dir():
        return []
    steps = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir():
            steps.append(int(m.group(1)))
    return sorted(steps)


def find_checkpoint(
    root: Path, load_step: int = -1, checksums: bool = True, skip_exports: bool = True
) -> Found | None:
    """The newest checkpoint under ``root`` that verifies and is not an ``export`` (or exactly
    ``load_step`` when >= 0).

    Every folder skipped on the way is logged with a warning naming it and the reason; a
    ``load_step`` that is missing, corrupt or an export is an error (the user asked for that
    one). ``skip_exports=False`` also accepts exports (for readers of the weights only, e.g.
    generation)."""
    if root.is_dir():
        for p in sorted(root.glob(f"step-*{TMP_SUFFIX}")):
            logger.warning(f"checkpoint: ignoring {p}: a save that never finished")
    steps = complete_steps(root)
    if load_step >= 0:
        path = step_dir(root, load_step)
        if load_step not in steps:
            raise FileNotFoundError(
                f"checkpoint.load_step = {load_step}: {path} does not exist (complete "
                f"checkpoints: {steps or 'none'})"
            )
        reason = verify(path, checksums)
        if reason is not None:
            raise RuntimeError(f"checkpoint.load_step = {load_step}: {path} is invalid: {reason}")
        if skip_exports and kind(path) == "export":
            raise RuntimeError(
                f"checkpoint.load_step = {load_step}: {path} is a model-only export "
                "(checkpoint.last_save_model_only) and cannot be resumed; load its weights with "
                "checkpoint.initial_load_path in a fresh dump folder, or pick an interval step"
            )
        return Found(load_step, path)
    for step in reversed(steps):
        path = step_dir(root, step)
        reason = verify(path, checksums)
        if reason is None and skip_exports and kind(path) == "export":
            logger.info(f"checkpoint: {path} is a model-only export; not resuming from it")
            continue
        if reason is None:
            return Found(step, path)
        logger.warning(f"checkpoint: skipping {path}: {reason}; trying the previous one")
    return None


def purge(root: Path, keep_latest_k: int, newest: int) -> list[Path]:
    """Delete complete checkpoints beyond the newest ``keep_latest_k`` and unfinished
    ``.tmp`` folders older than ``newest`` (the step just committed). Exports are neither
    counted nor deleted: they are the run's product, and counting them could delete the last
    checkpoint a restart can resume from. Returns what was removed."""
    removed: list[Path] = []
    for p in root.glob(f"step-*{TMP_SUFFIX}"):
        m = re.match(r"^step-(\d+)\.tmp$", p.name)
        if m and int(m.group(1)) < newest:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    if keep_latest_k > 0:
        resumable = [s for s in complete_steps(root) if kind(step_dir(root, s)) != "export"]
        for step in resumable[:-keep_latest_k]:
            path = step_dir(root, step)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


# ---------------------------------------------------------------- single-process model weights
def read_model_weights(folder: Path) -> dict:
    """The full (unsharded) ``model`` entries of a checkpoint folder as plain tensors, keyed by
    parameter name, read in this process without a process group (for conversion scripts)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from torchtitan.checkpoint.trust import SafeFileSystemReader, SafeLoadPlanner
    from torchtitan.tools.torch_compat import single_process_dcp

    metadata = SafeFileSystemReader(str(folder)).read_metadata()
    model: dict = {}
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata):
            model[key.removeprefix("model.")] = torch.empty(meta.size, dtype=meta.properties.dtype)
    if not model:
        raise ValueError(f"{folder} holds no model weights")
    with single_process_dcp():
        dcp.load(
            {"model": model},
            storage_reader=SafeFileSystemReader(str(folder)),
            planner=SafeLoadPlanner(),
            no_dist=True,
        )
    return model


def write_model_weights(root: Path, step: int, model: dict, kind: str = "seed") -> Path:
    """Write a model-only checkpoint ``root/step-<step>`` (temporary folder, manifest, rename)
    from one process; loadable by the trainer as a checkpoint holding only ``model``."""
    import torch.distributed.checkpoint as dcp

    from torchtitan.tools.torch_compat import single_process_dcp

    tmp = tmp_dir(root, step)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    with single_process_dcp():
        dcp.save({"model": model}, checkpoint_id=str(tmp), no_dist=True)
    return commit(root, step, {}, world_size=1, kind=kind)


def read_hf_folder(folder: Path) -> tuple[dict, dict]:
    """A Hugging Face model folder: (``config.json`` as a dict, every tensor of its
    ``*.safetensors`` files, sharded or not, by HF name)."""
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} holds no *.safetensors files")
    tensors: dict = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return json.loads((folder / "config.json").read_text()), tensors
