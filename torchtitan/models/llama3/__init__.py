"""Llama 3 (3, 3.1, 3.2 text) decoder-only transformer: arguments, flavors, the module, its
parallel plan and its Hugging Face mapping, put together as a ``FamilySpec`` (models/spec.py)."""

from __future__ import annotations

from torchtitan.models.llama3.args import LLAMA3_FLAVORS, ModelArgs
from torchtitan.models.llama3.hf import LLAMA3_HF
from torchtitan.models.llama3.model import Transformer
from torchtitan.models.llama3.parallel_plan import llama3_parallel_plan
from torchtitan.models.spec import FamilySpec

llama3_spec = FamilySpec(
    name="llama3", flavors=LLAMA3_FLAVORS, model=Transformer, plan=llama3_parallel_plan,
    hf=LLAMA3_HF, hf_model_types=("llama",),
)  # fmt: skip

__all__ = ["LLAMA3_FLAVORS", "ModelArgs", "Transformer", "llama3_spec"]
