"""Adapters in PEFT's format (docs/lora.md, "Interop"): ``adapter_config.json`` +
``adapter_model.safetensors`` with transformers' module names, taken from the family's
``HFMapping`` through its ``StateDictAdapter`` (``models/common/hf/``), and the merged export
(base + scaled ``B @ A`` as plain Hugging Face weights).

Works on full (unsharded) state dicts of ours. ``lora_B`` has the output rows of the weight it
adapts, so it takes the weight's row transform (the RoPE row order of ``wq``/``wk``); ``lora_A``
has its input columns, which no mapping transforms. Grouped-expert adapters have no PEFT
counterpart here (transformers holds those experts as fused 3-D tensors): exporting them is
refused, the merged export carries them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchtitan.config.job_config import Lora
from torchtitan.lora.layers import is_adapter_name, lora_scaling

__all__ = [
    "AdapterMismatch",
    "check_adapters",
    "linear_modules",
    "load_into",
    "load_peft_adapters",
    "merge_adapters",
    "peft_config",
    "peft_modules",
    "save_peft_adapters",
    "targets_from_adapter",
    "to_peft",
]

PEFT_PREFIX = "base_model.model."
_WEIGHTS, _CONFIG = "adapter_model.safetensors", "adapter_config.json"


def _hf_name(adapter: Any, weight_key: str) -> tuple[str, Any]:
    """(the HF module name of our ``<module>.weight``, its row transform or None)."""
    m = getattr(adapter, "mapping", None)
    if m is None:  # names are transformers' own already (the hf family, docs/hf_models.md)
        return weight_key.removesuffix(".weight"), None
    if hasattr(adapter, "peft_key"):  # DeepSeek-V3's MTP modules: under their HF layers
        weight_key = adapter.peft_key(weight_key)
        if weight_key.startswith(m.layers[1]):  # a Hugging Face name already
            return weight_key.removesuffix(".weight"), None
    if weight_key in m.top:
        return m.top[weight_key].removesuffix(".weight"), None
    found = re.match(rf"^{re.escape(m.layers[0])}\.(\d+)\.(.+)$", weight_key)
    if found is None or found.group(2) not in m.layer:
        raise KeyError(f"no Hugging Face name for {weight_key!r}")
    layer, local = found.groups()
    hf = f"{m.layers[1]}.{layer}.{m.layer[local]}".removesuffix(".weight")
    return hf, m.transforms.get(local)


def _modules(sd: dict[str, torch.Tensor]) -> list[str]:
    """Our adapted ``nn.Linear`` module names; grouped-expert adapters are refused."""
    stacked = [k for k in sd if is_adapter_name(k) and k.rsplit(".", 1)[-1].startswith("lora_A_")]
    if stacked:
        raise ValueError(
            f"{stacked[0]}: grouped-expert adapters have no PEFT format here (transformers holds "
            "the experts as fused 3-D tensors); use the merged export (docs/lora.md)"
        )
    return sorted(k.removesuffix(".lora_A") for k in sd if k.endswith(".lora_A"))


def to_peft(sd: dict[str, torch.Tensor], adapter: Any) -> dict[str, torch.Tensor]:
    """PEFT's ``adapter_model`` tensors from our full adapter (or model) state dict."""
    out: dict[str, torch.Tensor] = {}
    for module in _modules(sd):
        hf, rows = _hf_name(adapter, f"{module}.weight")
        b = sd[f"{module}.lora_B"]
        b = rows.to_hf(b, adapter.args) if rows is not None else b
        out[f"{PEFT_PREFIX}{hf}.lora_A.weight"] = sd[f"{module}.lora_A"].contiguous()
        out[f"{PEFT_PREFIX}{hf}.lora_B.weight"] = b.contiguous()
    return out


def peft_config(cfg: Lora, target_modules: list[str], base: str) -> dict[str, Any]:
    """``adapter_config.json`` for PEFT's ``LoraConfig`` (exact module names as targets)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "use_rslora": cfg.use_rslora,
        "target_modules": target_modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }


def save_peft_adapters(
    folder: Path, sd: dict[str, torch.Tensor], adapter: Any, cfg: Lora, base: str = ""
) -> dict[str, torch.Tensor]:
    """Write ``folder/adapter_config.json`` and ``adapter_model.safetensors``; returns the
    tensors written."""
    from safetensors.torch import save_file

    peft = to_peft(sd, adapter)
    targets = sorted({k.removeprefix(PEFT_PREFIX).rsplit(".", 2)[0] for k in peft})
    folder.mkdir(parents=True, exist_ok=True)
    save_file(peft, str(folder / _WEIGHTS), metadata={"format": "pt"})
    text = json.dumps(peft_config(cfg, targets, base), indent=2)
    (folder / _CONFIG).write_text(text + "\n")
    return peft


def load_peft_adapters(
    folder: Path, adapter: Any, our_modules: list[str]
) -> tuple[dict[str, torch.Tensor], Lora]:
    """Our adapter tensors (for ``our_modules``, the adapted ``nn.Linear`` names of a model
    built with the returned ``Lora`` settings) from a PEFT folder."""
    from safetensors.torch import load_file

    config = json.loads((folder / _CONFIG).read_text())
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{folder / _CONFIG}: peft_type {config.get('peft_type')!r}, not LORA")
    peft = {k.replace(".default", ""): v for k, v in load_file(str(folder / _WEIGHTS)).items()}
    out: dict[str, torch.Tensor] = {}
    for module in our_modules:
        hf, rows = _hf_name(adapter, f"{module}.weight")
        a, b = (peft.get(f"{PEFT_PREFIX}{hf}.lora_{x}.weight") for x in "AB")
        if a is None or b is None:
            raise KeyError(f"{folder / _WEIGHTS}: no adapter for {hf} (our {module})")
        b = rows.from_hf(b, adapter.args) if rows is not None else b
        out[f"{module}.lora_A"], out[f"{module}.lora_B"] = a.contiguous(), b.contiguous()
    cfg = Lora(
        enable=True,
        rank=int(config["r"]),
        alpha=float(config["lora_alpha"]),
        dropout=float(config.get("lora_dropout", 0.0)),
        use_rslora=bool(config.get("use_rslora", False)),
        target_modules=our_modules,
    )
    return out, cfg


@torch.no_grad()
def merge_adapters(sd: dict[str, torch.Tensor], cfg: Lora) -> dict[str, torch.Tensor]:
    """The full model state dict with every adapter folded into its weight (``W + s B A``;
    experts ``w[e] + s A[e] B[e]``) and the adapter entries dropped."""
    s = lora_scaling(cfg.rank, cfg.alpha, cfg.use_rslora)
    out = {k: v for k, v in sd.items() if not is_adapter_name(k)}
    for key, a in sd.items():
        module, _, leaf = key.rpartition(".")
        if leaf == "lora_A":
            w = out[f"{module}.weight"]
            delta = sd[f"{module}.lora_B"].float() @ a.float()
            out[f"{module}.weight"] = (w.float() + s * delta).to(w.dtype)
        elif leaf.startswith("lora_A_"):
            name = leaf.removeprefix("lora_A_")
            w = out[f"{module}.{name}"]
            delta = torch.bmm(a.float(), sd[f"{module}.lora_B_{name}"].float())
            out[f"{module}.{name}"] = (w.float() + s * delta).to(w.dtype)
    return out


class AdapterMismatch(ValueError):
    """A PEFT folder that does not fit the ``[lora]`` settings; one line: the rule, then
    ``fix`` (``preflight/validate_lora.py`` turns it into a ``ConfigError`` on
    ``lora.adapter_path``)."""

    def __init__(self, rule: str, fix: str) -> None:
        self.rule, self.fix = rule, fix
        super().__init__(f"{rule}. Fix: {fix}.")


def _listed(names: list[str], most: int = 4) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def peft_modules(folder: Path) -> list[str]:
    """The transformers module names ``folder``'s ``adapter_model.safetensors`` adapts (a
    ``lora_A`` and a ``lora_B`` each; PEFT's adapter name ``.default`` dropped)."""
    from safetensors import safe_open

    with safe_open(str(folder / _WEIGHTS), framework="pt") as f:
        keys = {k.replace(".default", "") for k in f.keys()}  # noqa: SIM118
    return sorted(
        k.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight")
        for k in keys
        if k.endswith(".lora_A.weight") and k.replace(".lora_A.", ".lora_B.") in keys
    )


def linear_modules(model: nn.Module, adapter: Any) -> dict[str, str]:
    """transformers module name -> our module name, for every ``nn.Linear`` of ``model`` (a
    model or one pipeline stage; adapted or not) that has a Hugging Face name."""
    out: dict[str, str] = {}
    for fqn, module in model.named_modules():
        if not fqn or not isinstance(module, nn.Linear):
            continue
        name = _unwrapped(fqn)
        try:
            out[_hf_name(adapter, f"{name}.weight")[0]] = name
        except KeyError:
            continue
    return out


def targets_from_adapter(folder: Path, adapter: Any, model: nn.Module) -> list[str]:
    """Our module names for every module ``folder`` adapts (``lora.adapter_targets =
    "from_adapter"``); ``model``: the whole model, built without adapters."""
    names = linear_modules(model, adapter)
    theirs = peft_modules(folder)
    unknown = [m for m in theirs if m not in names]
    if unknown:
        raise AdapterMismatch(
            f"{folder} adapts {_listed(unknown)}, no nn.Linear projection of this model",
            "use an adapter folder written for this model family and shape",
        )
    if not theirs:
        raise AdapterMismatch(f"{folder / _WEIGHTS} holds no LoRA adapters", "fix the folder")
    return sorted(names[m] for m in theirs)


def check_adapters(folder: Path, adapter: Any, model: nn.Module, cfg: Lora) -> None:
    """``AdapterMismatch`` unless ``folder`` has exactly the adapters of ``model`` (built with
    ``cfg``'s adapters; a pipeline stage checks the modules it holds) and ``cfg``'s rank, alpha
    and use_rslora."""
    config = json.loads((folder / _CONFIG).read_text())
    theirs = (int(config["r"]), float(config["lora_alpha"]), bool(config.get("use_rslora", False)))
    ours = (cfg.rank, cfg.alpha, cfg.use_rslora)
    if theirs != ours:
        rank, alpha, rslora = theirs
        raise AdapterMismatch(
            f"{folder}: r={rank}, lora_alpha={alpha:g}, use_rslora={rslora}, but [lora] has "
            f"rank={cfg.rank}, alpha={cfg.alpha:g}, use_rslora={cfg.use_rslora}",
            f"set --lora.rank {rank} --lora.alpha {alpha:g}"
            + (" --lora.use_rslora" if rslora else "")
            + " (the adapters were trained with them)",
        )
    names = linear_modules(model, adapter)
    with_lora = {_unwrapped(f) for f, m in model.named_modules() if hasattr(m, "lora_A")}
    adapted = {hf for hf, ours_name in names.items() if ours_name in with_lora}
    have = set(peft_modules(folder))
    extra = sorted(m for m in have if m in names and m not in adapted)
    missing = sorted(adapted - have)
    if extra:
        locals_ = sorted({_local(names[m]) for m in extra})
        raise AdapterMismatch(
            f"{folder} has adapters for {len(extra)} modules lora.target_modules leaves out: "
            f"{_listed(extra)}",
            f"add {','.join(locals_)} to --lora.target_modules, or load every adapter the "
            "folder has with --lora.adapter_targets from_adapter",
        )
    if missing:
        raise AdapterMismatch(
            f"{folder} has no adapters for {len(missing)} modules lora.target_modules adapts: "
            f"{_listed(missing)}",
            "remove them from --lora.target_modules, or adapt what the folder has with "
            "--lora.adapter_targets from_adapter",
        )


def _unwrapped(fqn: str) -> str:
    return fqn.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")


def _local(name: str) -> str:
    """``layers.3.attention.wq`` -> ``attention.wq`` (a target pattern for every layer)."""
    parts = name.split(".")
    return ".".join(parts[2:]) if len(parts) > 2 and parts[1].isdigit() else name


def load_into(part: nn.Module, folder: Path, adapter: Any, cfg: Lora) -> int:
    """Start ``part``'s adapters (one model, or one pipeline stage; any parallel layout) from a
    PEFT folder written for the same settings and modules (``check_adapters``); returns the
    number of tensors loaded."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    check_adapters(folder, adapter, part, cfg)
    names = [_unwrapped(n) for n, _ in part.named_parameters()]
    modules = sorted(n.removesuffix(".lora_A") for n in names if n.endswith(".lora_A"))
    got, _ = load_peft_adapters(folder, adapter, modules)
    options = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(part, dict[str, Any](got), options=options)
    return len(got)
