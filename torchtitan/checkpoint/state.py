"""What a checkpoint holds besides the DCP plumbing: the model and optimizer state dicts of
the model parts (pipeline stages merged by name), and every rank's RNG states as one opaque,
pickle-free blob (docs/checkpoint.md)."""

from __future__ import annotations

import random
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from torchtitan.checkpoint.trust import UntrustedCheckpointError, decode_state, encode_state
from torchtitan.distributed.utils import device_type

__all__ = [
    "load_model_state_dict",
    "load_optimizer_state_dict",
    "model_state_dict",
    "optimizer_state_dict",
    "rng_state",
    "set_rng_state",
]


def model_state_dict(parts: list[nn.Module]) -> dict[str, Any]:
    """Parameters and buffers of all model parts, keyed by their names in the full model
    (pipeline stages keep the full model's names, so the parts never collide)."""
    sd: dict[str, Any] = {}
    for part in parts:
        own = get_model_state_dict(part)
        # A part with ``checkpoint_keys`` (a name predicate) saves and resumes only those
        # entries: LoRA adapters over a base loaded from elsewhere (docs/lora.md).
        keep = getattr(part, "checkpoint_keys", None)
        sd.update({k: v for k, v in own.items() if keep(k)} if callable(keep) else own)
    return sd


def load_model_state_dict(parts: list[nn.Module], sd: dict[str, Any]) -> None:
    for part in parts:
        set_model_state_dict(part, sd, options=StateDictOptions(strict=False))


def _strip_part_index(name: str) -> str:
    return name.split(".", 1)[1]


def _group_name(group: dict[str, Any], index: int) -> str:
    return str(group.get("group", f"group{index}"))


def optimizer_state_dict(
    parts: list[nn.Module], optimizer: torch.optim.Optimizer, legacy: bool = False
) -> dict:
    """The optimizer state keyed by full-model parameter names.

    torch's helper maps parameters to names through one module; one optimizer spans all parts
    here, so the parts go in an ``nn.ModuleList`` and its ``<index>.`` prefix is removed (the
    index of a stage on this rank is not a property of the model, and changes with the
    pipeline layout).

    ``param_groups`` are keyed by group name, without their parameter names: DCP keeps one copy
    of each non-tensor entry, and under pipeline parallel each rank's groups hold its own
    stages' parameters, in an order of their own (stage 0 has the embedding's group, the last
    stage the output's); a group's hyperparameters are the same on every rank that has it.
    ``legacy``: the list form of checkpoints written before (matched by position on load)."""
    osd: dict[str, Any] = get_optimizer_state_dict(nn.ModuleList(parts), optimizer)  # type: ignore[assignment]
    state = {_strip_part_index(k): v for k, v in osd["state"].items()}
    if legacy:
        groups: Any = [
            {**g, "params": [_strip_part_index(k) for k in g["params"]]}
            for g in osd["param_groups"]
        ]
    else:
        groups = {
            _group_name(g, i): {k: v for k, v in g.items() if k != "params"}
            for i, g in enumerate(osd["param_groups"])
        }
    return {"state": state, "param_groups": groups}


def load_optimizer_state_dict(
    parts: list[nn.Module], optimizer: torch.optim.Optimizer, osd: dict
) -> None:
    """Load ``osd`` (from :func:`optimizer_state_dict`): each of this optimizer's groups keeps
    its own parameters and takes the hyperparameters saved under its name (or, from a legacy
    checkpoint, at its position)."""
    prefixed = {
        name: f"{i}.{name}" for i, part in enumerate(parts) for name, _ in part.named_parameters()
    }
    current: dict[str, Any] = get_optimizer_state_dict(nn.ModuleList(parts), optimizer)  # type: ignore[assignment]
    loaded = osd["param_groups"]
    groups = []
    for i, own in enumerate(current["param_groups"]):
        if isinstance(loaded, list):
            saved = loaded[i]
        else:
            name = _group_name(own, i)
            if name not in loaded:
                raise RuntimeError(
                    f"the checkpoint has no optimizer param group {name!r} "
                    f"(it has {sorted(loaded)}): the optimizer groups changed since it was saved"
                )
            saved = loaded[name]
        groups.append({**saved, "params": own["params"]})
    full = {"state": {prefixed[k]: v for k, v in osd["state"].items()}, "param_groups": groups}
    set_optimizer_state_dict(nn.ModuleList(parts), optimizer, full)  # type: ignore[arg-type]


# ---------------------------------------------------------------- RNG
def _tensor_bytes(t: torch.Tensor) -> bytes:
    # Raw bytes, not a pickled tensor: a tensor's pickle holds its storage address, so equal
    # states would give different checkpoint bytes.
    return t.cpu().numpy().tobytes()


def _bytes_tensor(b: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(b), dtype=torch.uint8)


def rng_state() -> torch.Tensor:
    """This rank's RNG states: torch CPU (and CUDA) generators and Python's ``random``."""
    state: dict[str, Any] = {
        "torch": _tensor_bytes(torch.get_rng_state()),
        "python": random.getstate(),
    }
    if device_type() == "cuda":
        state["cuda"] = [_tensor_bytes(t) for t in torch.cuda.get_rng_state_all()]
    return encode_state(state)


def set_rng_state(blob: torch.Tensor) -> None:
    state = decode_state(blob)
    torch.set_rng_state(_bytes_tensor(state["torch"]))
    random.setstate(state["python"])
    if "cuda" in state and device_type() == "cuda":
        torch.cuda.set_rng_state_all([_bytes_tensor(b) for b in state["cuda"]])


def saved_blank(metadata: Any, path: Any, key: str) -> torch.Tensor:
    """A uint8 tensor of the size of the saved bytes entry ``key`` (what DCP loads it into);
    a pickled object (a checkpoint written before the trust model) is refused."""
    size = getattr(metadata[key], "size", None)
    if size is None:
        raise UntrustedCheckpointError(
            f"checkpoint {path}: {key} is a pickled object (a checkpoint written by an "
            "older version), which this version does not unpickle (docs/checkpoint.md, "
            "'Trust model'); load its weights with checkpoint.initial_load_path, which "
            "loads only the model by default"
        )
    return torch.empty(size, dtype=torch.uint8)


def dataloader_target(
    saved: set[str], own_state: dict[str, Any], blank: Any
) -> dict[str, torch.Tensor]:
    """What DCP loads the data loader's position into: this rank's saved entry, or under
    another data-parallel size any rank's (the same global position under window sharding;
    the loader refuses it otherwise)."""
    keys = sorted(k.split(".", 1)[1] for k in saved if k.startswith("dataloader.dp_rank_"))
    own = next((k for k in own_state if k.startswith("dp_rank_")), "")
    key = own if own in keys else keys[0]
    return {key: blank(f"dataloader.{key}"), "dp_world_size": torch.tensor(0)}
