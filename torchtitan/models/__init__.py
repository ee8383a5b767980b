"""Model registry: family name -> ModelSpec, written out by hand (one line per family; see
docs/extending.md)."""

from __future__ import annotations

from torchtitan.models.deepseek_v3 import deepseek_v3_spec
from torchtitan.models.llama3 import llama3_spec
from torchtitan.models.qwen3 import qwen3_spec
from torchtitan.models.spec import ModelSpec, runtime_args

MODELS: dict[str, ModelSpec] = {
    "llama3": llama3_spec,
    "qwen3": qwen3_spec,
    "deepseek_v3": deepseek_v3_spec,
}

__all__ = ["MODELS", "ModelSpec", "runtime_args"]
