"""Qwen3 dense and Qwen3-MoE decoder-only transformers: arguments, flavors, the module, its
parallel plan and its Hugging Face mapping, put together as a ``FamilySpec`` (models/spec.py;
docs/moe.md for the MoE layer)."""

from __future__ import annotations

from torchtitan.models.common.moe_hooks import MOE_HOOKS
from torchtitan.models.qwen3.args import QWEN3_FLAVORS, Qwen3Args
from torchtitan.models.qwen3.hf import QWEN3_HF
from torchtitan.models.qwen3.model import Transformer
from torchtitan.models.qwen3.parallel_plan import qwen3_parallel_plan
from torchtitan.models.spec import FamilySpec

qwen3_spec = FamilySpec(
    name="qwen3", flavors=QWEN3_FLAVORS, model=Transformer, plan=qwen3_parallel_plan,
    hf=QWEN3_HF, hf_model_types=("qwen3", "qwen3_moe"),
    hooks=MOE_HOOKS,
)  # fmt: skip

__all__ = ["QWEN3_FLAVORS", "Qwen3Args", "Transformer", "qwen3_spec"]
