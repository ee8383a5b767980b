"""Qwen3.5 dense and MoE text decoders (Gated DeltaNet + gated full attention): arguments,
flavors, the module, its parallel plan and its Hugging Face mapping, put together as a
``FamilySpec`` (models/spec.py; docs/qwen3_5.md)."""

from __future__ import annotations

import dataclasses
from typing import Any

from torchtitan.models.common.moe_hooks import MOE_HOOKS
from torchtitan.models.qwen3_5.args import QWEN35_FLAVORS, Qwen35Args
from torchtitan.models.qwen3_5.hf import QWEN35_HF, Qwen35StateDictAdapter
from torchtitan.models.qwen3_5.model import Qwen35Transformer
from torchtitan.models.qwen3_5.parallel_plan import qwen35_parallel_plan
from torchtitan.models.spec import FamilySpec


@dataclasses.dataclass(frozen=True)
class Qwen35Spec(FamilySpec):
    """``FamilySpec`` whose adapter also reads the text decoder of the published multimodal
    checkpoints (``hf.py: Qwen35StateDictAdapter``)."""

    def state_dict_adapter(self, args: Any) -> Qwen35StateDictAdapter:
        return Qwen35StateDictAdapter(QWEN35_HF, args)


qwen3_5_spec = Qwen35Spec(
    "qwen3_5",
    QWEN35_FLAVORS,
    Qwen35Transformer,
    qwen35_parallel_plan,
    QWEN35_HF,
    ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe"),
    lora_targets=(
        "attention.wq",
        "attention.wk",
        "attention.wv",
        "attention.wo",
        "linear_attn.wqkv",
        "linear_attn.wz",
        "linear_attn.wo",
    ),
    hooks=MOE_HOOKS,
)

__all__ = ["QWEN35_FLAVORS", "Qwen35Args", "Qwen35Transformer", "qwen3_5_spec"]
