"""The steps the families' Hugging Face parity tests share (``tests/unit/test_<family>.py``,
``tests/hf_generate.py``): the token batch, writing our model as a Hugging Face folder, reading
a transformers model back into ours (the family from ``config.json``), the max logit
difference."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from torchtitan.checkpoint.storage import read_hf_folder
from torchtitan.models import MODELS, family_for_hf_config


def tokens() -> torch.Tensor:
    """Two rows of 40 token ids below 256 (the tiny vocabularies), the same every call."""
    return torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))


def export_hf(model: torch.nn.Module, adapter: Any, folder: Path) -> None:
    """``model``'s weights (``model.safetensors``) and ``config.json`` through ``adapter``."""
    from safetensors.torch import save_file

    save_file(adapter.to_hf(dict(model.state_dict())), str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(adapter.hf_config()))


def export_logit_diff(model: torch.nn.Module, adapter: Any, hf_class: Any, folder: Path) -> float:
    """:func:`export_hf` to ``folder``, read by transformers' ``hf_class`` (fp32, eager
    attention): the :func:`logit_diff` of the two models in eval mode."""
    export_hf(model, adapter, folder)
    hf = hf_class.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    return logit_diff(model.eval(), hf.eval())


def import_hf(hf: Any, folder: Path) -> tuple[Any, Any, dict[str, torch.Tensor]]:
    """The transformers model ``hf`` saved to ``folder`` and read back: (our args, our model
    with its weights, strictly loaded, the Hugging Face state dict)."""
    hf.save_pretrained(folder)
    config, hf_sd = read_hf_folder(folder)
    family, args = family_for_hf_config(config)
    ours = MODELS[family].build(args)
    ours.load_state_dict(MODELS[family].state_dict_adapter(args).from_hf(hf_sd), strict=True)
    ours.init_buffers()  # type: ignore[operator]
    return args, ours, hf_sd


def logit_diff(ours: torch.nn.Module, hf: Any) -> float:
    """Max abs difference of the two models' logits on :func:`tokens` (no gradients)."""
    with torch.no_grad():
        return (ours(tokens()) - hf(tokens()).logits).abs().max().item()
