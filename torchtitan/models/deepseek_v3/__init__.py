"""DeepSeek-V3 (and V2-Lite-shaped) decoder-only transformers: multi-head latent attention,
dense then MoE blocks, YaRN RoPE and multi-token prediction; arguments, flavors, the module,
its parallel plan and its Hugging Face mapping, put together as a ``FamilySpec``
(models/spec.py; docs/deepseek_v3.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torchtitan.models.deepseek_v3.args import DEEPSEEK_V3_FLAVORS, DeepSeekV3Args
from torchtitan.models.deepseek_v3.hf import DEEPSEEK_V3_HF, DeepSeekV3Adapter
from torchtitan.models.deepseek_v3.model import Transformer
from torchtitan.models.deepseek_v3.mtp import DEEPSEEK_V3_HOOKS
from torchtitan.models.deepseek_v3.parallel_plan import deepseek_v3_parallel_plan
from torchtitan.models.spec import FamilySpec


@dataclass(frozen=True)
class DeepSeekV3Spec(FamilySpec):
    """The shared spec; its adapter also converts the MTP layers (``hf.py``)."""

    def state_dict_adapter(self, args: Any) -> DeepSeekV3Adapter:
        return DeepSeekV3Adapter(DEEPSEEK_V3_HF, args)


deepseek_v3_spec = DeepSeekV3Spec(
    "deepseek_v3",
    DEEPSEEK_V3_FLAVORS,
    Transformer,
    deepseek_v3_parallel_plan,
    DEEPSEEK_V3_HF,
    hf_model_types=("deepseek_v3",),
    lora_targets=tuple(f"attention.{w}" for w in ("wq", "wq_a", "wq_b", "wkv_a", "wkv_b", "wo")),
    hooks=DEEPSEEK_V3_HOOKS,
)

__all__ = ["DEEPSEEK_V3_FLAVORS", "DeepSeekV3Args", "Transformer", "deepseek_v3_spec"]
