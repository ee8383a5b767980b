"""Model registry: family name -> ModelSpec, written out by hand."""

from __future__ import annotations

from torchtitan.models.llama3 import llama3_spec
from torchtitan.models.spec import ModelSpec

MODELS: dict[str, ModelSpec] = {"llama3": llama3_spec}
